"""The work a load run sends: prompt and output lengths drawn from seeded distributions, prompt
texts of exactly the drawn number of tokens, and the arrival times of an open-loop run.

Lengths are given as `N` (fixed), `LO-HI` (uniform integers, both ends included) or
`normal:MEAN,STD` (rounded, at least 1). Prompts are random words that are each one token of the
model's own vocabulary, so a prompt of N words is N tokens for any server tokenizing with that
GGUF, and no two requests share more than the chat template's prefix.
"""

from __future__ import annotations

import math
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path

WORD = re.compile(r"[a-z]{3,10}")
POOL_SIZE = 4000      # distinct words to draw from: enough that prompts do not repeat


class WorkloadError(ValueError):
    """A length distribution or rate that cannot be used; the message names it."""


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts: fixed (low == high, std 0), uniform in [low, high], or normal."""

    kind: str          # "fixed" | "uniform" | "normal"
    low: float
    high: float = 0.0  # uniform: the upper end; normal: the standard deviation

    @classmethod
    def parse(cls, text: str) -> "LengthDistribution":
        text = text.strip()
        try:
            if text.startswith("normal:"):
                mean, std = (float(v) for v in text[len("normal:"):].split(","))
                if mean < 1 or std < 0:
                    raise WorkloadError(f"{text}: needs MEAN >= 1 and STD >= 0")
                return cls("normal", mean, std)
            if "-" in text:
                low, high = (int(v) for v in text.split("-"))
                if not 1 <= low <= high:
                    raise WorkloadError(f"{text}: needs 1 <= LO <= HI")
                return cls("uniform", low, high)
            value = int(text)
        except ValueError as exc:
            if isinstance(exc, WorkloadError):
                raise
            raise WorkloadError(f"{text!r}: use N, LO-HI or normal:MEAN,STD") from None
        if value < 1:
            raise WorkloadError(f"{text}: a length is at least 1 token")
        return cls("fixed", value, value)

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.low)
        if self.kind == "uniform":
            return rng.randint(int(self.low), int(self.high))
        return max(1, round(rng.gauss(self.low, self.high)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.low))
        if self.kind == "uniform":
            return f"{int(self.low)}-{int(self.high)}"
        return f"normal:{self.low:g},{self.high:g}"


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: its user message and how many tokens it asks for."""

    index: int
    prompt: str
    prompt_tokens: int    # of the user message alone; the chat template adds its own
    output_tokens: int


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    """Seconds after the start at which each of `count` requests is sent: a Poisson process of
    `rate` requests/s (exponential gaps from a seeded generator), or all at 0 for rate inf."""
    if not rate > 0:
        raise WorkloadError(f"rate {rate}: a rate is > 0 (inf: every request at once)")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


class PromptWriter:
    """Prompts of an exact token count from one-token words of a GGUF's vocabulary."""

    def __init__(self, model: Path):
        from freetoken.models.checkpoint.gguf_file import GGUFFile
        from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

        meta = GGUFFile(model).meta
        self.tokenizer = tokenizer_from_gguf(meta, str(model))
        self.words = self._one_token_words(meta["tokenizer.ggml.tokens"])
        self.separator = " "
        if len(self.words) < 100:
            # a placeholder vocabulary (random-weight benchmark files): letters and digits
            # that are one token each, run together
            self.words, self.separator = self._one_token_characters(), ""
        if len(self.words) < 20:
            raise WorkloadError(f"{model}: only {len(self.words)} one-token words or "
                                "characters in its vocabulary; cannot write prompts from it")

    def _one_token_words(self, tokens: list[str]) -> list[str]:
        """Lower-case words that follow a space as exactly one token (BPE's `Ġword`,
        SentencePiece's `▁word`), the first POOL_SIZE in vocabulary order."""
        base = len(self.tokenizer.encode("the"))
        words = []
        for token in tokens:
            word = token[1:]
            if token[:1] not in ("Ġ", "▁") or not WORD.fullmatch(word):
                continue
            if len(self.tokenizer.encode("the " + word)) == base + 1:
                words.append(word)
                if len(words) == POOL_SIZE:
                    break
        return words

    def _one_token_characters(self) -> list[str]:
        chars = string.ascii_letters + string.digits
        return [c for c in chars if len(self.tokenizer.encode(c)) == 1]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def write(self, tokens: int, rng: random.Random) -> tuple[str, int]:
        """(text, its token count): random words, trimmed or extended until the count is
        `tokens` (the first word may take two tokens without its space)."""
        words = rng.choices(self.words, k=tokens)
        for _ in range(4):
            got = self.count(self.separator.join(words))
            if got == tokens:
                break
            if got > tokens:
                words = words[:max(1, len(words) - (got - tokens))]
            else:
                words += rng.choices(self.words, k=tokens - got)
        text = self.separator.join(words)
        return text, self.count(text)


def draw_requests(count: int, prompt_len: LengthDistribution, output_len: LengthDistribution,
                  writer: PromptWriter, seed: int) -> list[RequestSpec]:
    """`count` requests with lengths and words from one seeded generator: the same seed gives
    the same requests for every server."""
    rng = random.Random(seed)
    specs = []
    for index in range(count):
        text, tokens = writer.write(prompt_len.draw(rng), rng)
        specs.append(RequestSpec(index, text, tokens, output_len.draw(rng)))
    return specs
