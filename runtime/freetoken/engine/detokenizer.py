"""Token ids -> streamed text deltas, with stop strings cut out of the output.

Text is released only once it is final: bytes of an incomplete UTF-8 character wait for the
next token, and a tail that could be the start of a stop string waits until it is ruled out.
"""

from __future__ import annotations

from typing import Protocol, Sequence

PROMPT_CONTEXT_TOKENS = 4  # decoded alongside the output so a leading space survives decode()
MAX_PENDING_TOKENS = 8     # past this, undecodable bytes are really invalid: release them


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feeds one token at a time; `push` and `finish` return the text to emit now."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0                 # ids[prefix:read] were decoded last time
        self._read = len(self._ids)      # ids[read:] are not yet turned into text
        self._stop = tuple(stop)
        self.text = ""                   # the output text so far (cut at a matched stop)
        self._sent = 0                   # characters of `text` already released
        self.matched_stop: str | None = None

    def push(self, token_id: int) -> str:
        """Add one generated token; returns newly releasable text (often "")."""
        if self.matched_stop is not None:
            return ""
        self._ids.append(token_id)
        self._decode_new(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush everything held back (the request ended for another reason than a stop)."""
        if self.matched_stop is not None:
            return ""
        self._decode_new(final=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_new(self, final: bool) -> None:
        if self._read == len(self._ids):
            return
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        # NOTE: a trailing U+FFFD means a multi-byte character is still incomplete.
        complete = not after.endswith("\ufffd")
        if len(after) > len(before) and (final or complete
                                         or len(self._ids) - self._read >= MAX_PENDING_TOKENS):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

    def _release(self, final: bool) -> str:
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            self.matched_stop = stop
            self.text = self.text[:index]
        end = len(self.text) if (final or hit is not None) else len(self.text) - self._holdback()
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

    def _find_stop(self) -> tuple[int, str] | None:
        best = None
        for stop in self._stop:
            index = self.text.find(stop, self._sent)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _holdback(self) -> int:
        """Length of the longest unreleased tail that is a proper prefix of some stop string."""
        pending = len(self.text) - self._sent
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, pending), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
