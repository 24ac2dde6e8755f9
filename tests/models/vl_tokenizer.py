"""A byte-level tokenizer.json whose special tokens are Qwen's (ChatML and the image
placeholders) and a chat template that renders image items as Qwen3.5's does: shared by the
stand-in llama of the server tests and the served Qwen3.5 folder of the end-to-end tests."""

from __future__ import annotations

import json
from pathlib import Path

IMAGE_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", *IMAGE_SPECIALS, "<|im_end|>"]
# Content items as Qwen3.5's template reads them: a string, or text and image items (in tool
# results too); tool calls as Hermes writes them, so the served dialect renders tool turns.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for item in m['content'] %}{% if item.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in item %}{{ item.text }}"
    "{% else %}{{ raise_exception('Unexpected item type in content.') }}{% endif %}"
    "{% endfor %}{% endif %}{% for call in m.tool_calls or [] %}"
    "<tool_call>{{ call.function.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def printable_ascii() -> list[str]:
    """The byte-level characters of newline and the printable ASCII bytes: a vocabulary whose
    every token decodes to valid text, so generated text compares exactly."""
    from tokenizers import pre_tokenizers

    # GPT-2's byte-to-character map: printable bytes stand for themselves, the others
    # (space and newline among them) take the characters from U+0100 on, in byte order.
    keep = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    shifted = {b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in keep)}
    chars = [shifted.get(b, chr(b)) for b in [10, *range(32, 127)]]
    assert set(chars) <= set(pre_tokenizers.ByteLevel.alphabet())
    return chars


def write_vl_tokenizer(directory: Path, alphabet: list[str] | None = None,
                       specials: list[str] = SPECIALS) -> dict[str, int]:
    """tokenizer.json (one token per byte-level character of `alphabet`, default all 256,
    then `specials`) and tokenizer_config.json (TEMPLATE, eos <|im_end|>); returns the
    special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = alphabet or sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return {s: tok.token_to_id(s) for s in specials}
