"""Text <-> token ids over a `tokenizers` backend, streaming detokenization, chat templates."""

from __future__ import annotations

from typing import Any

from freetoken.models.tokenizer.chat_template import render_chat
from freetoken.models.errors import ChatTemplateError

# End-of-turn spellings: stop generation on these when the vocabulary marks them special.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>",
                      "<|end_of_text|>", "<end_of_turn>", "<|end|>", "</s>")


class Tokenizer:
    """A model's tokenizer.

    Attributes: ``eos_token_ids`` (tuple: every id that ends a reply), ``bos_token_id``,
    ``vocab_size`` (ids the tokenizer can produce), ``chat_template`` (jinja source or None).
    """

    def __init__(self, backend, *, chat_template: str | None, bos_token_id: int | None,
                 eos_token_ids: tuple[int, ...], special_tokens: dict[str, str | None]):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids + self._end_of_turn_ids()))

    def _end_of_turn_ids(self) -> tuple[int, ...]:
        special = {t.content for t in self.backend.get_added_tokens_decoder().values()
                   if t.special}
        ids = (self.backend.token_to_id(t) for t in END_OF_TURN_TOKENS if t in special)
        return tuple(i for i in ids if i is not None)

    def token_id(self, token: str | None) -> int | None:
        """The id of a token string, or None."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids. With
        add_special_tokens the model's own framing (e.g. a BOS) is added."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        """A fresh streaming decoder for one reply."""
        return IncrementalDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for `messages` (dicts with role and content); extra keyword
        arguments (tools, enable_thinking, ...) become template variables.
        Raises ChatTemplateError when the model has no template or it fails to render."""
        if not self.chat_template:
            raise ChatTemplateError(
                "this model ships no chat template; send raw text to /v1/completions instead")
        return render_chat(self.chat_template, messages, add_generation_prompt,
                           self.special_tokens, **kwargs)


class IncrementalDecoder:
    """Turns a growing list of ids into text deltas that never split a UTF-8 character.

    Decodes a short window of recent ids and emits what was added past the part already
    shown; a window ending in U+FFFD (an incomplete byte sequence) waits for more ids.
    """

    _MAX_PENDING = 8    # give up waiting after this many ids: the bytes are really invalid

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0     # start of the decode window
        self._read = 0       # ids[:_read] are already emitted as text

    def _text(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self.ids[start:end], skip_special_tokens=self._skip)

    def push(self, new_ids: list[int] | int) -> str:
        """Append ids; return the newly completed text (may be empty)."""
        self.ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        shown = self._text(self._prefix, self._read)
        full = self._text(self._prefix)
        pending = len(self.ids) - self._read
        if len(full) <= len(shown) or (full.endswith("\ufffd") and pending < self._MAX_PENDING):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full[len(shown):]

    def flush(self) -> str:
        """Whatever text is still held back (call once at the end of a reply)."""
        if self._read == len(self.ids):
            return ""
        shown = self._text(self._prefix, self._read)
        full = self._text(self._prefix)
        self._prefix = self._read = len(self.ids)
        return full[len(shown):]
