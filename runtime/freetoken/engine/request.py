"""Request state inside the engine, sampling parameters and the outputs the engine emits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import numpy as np

    from freetoken.engine.detokenizer import IncrementalDetokenizer
    from freetoken.engine.guide import Guide
    from freetoken.models.config import GenerationDefaults

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
FINISH_REASONS = ("stop", "length", "abort", "error")


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; the message names it."""


class RequestRejected(ValueError):
    """The engine cannot serve this request (too long for the context or the KV pool, empty)."""


class PromptTooLong(RequestRejected):
    """Prompt plus max_tokens exceed what one request may hold (context or KV pool)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. None means "unset": the engine fills it from the model's
    generation defaults (sampling_defaults="model") or from neutral defaults."""

    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None          # 0 = off
    top_p: float | None = None        # 1 = off
    max_tokens: int | None = None     # unset = up to the request's context limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # OpenAI: subtracted once from every generated token
    frequency_penalty: float = 0.0    # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # CTRL/HF: logits of prompt and output tokens divided by it
    logprobs: int | None = None       # None = off; else report each token's log-probability
                                      # and this many most likely alternatives

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.max_tokens
        if t is not None and not (math.isfinite(t) and t >= 0):
            raise InvalidSamplingParams(f"temperature must be >= 0 (0 = greedy); got {t}")
        if k is not None and (not isinstance(k, int) or k < 0):
            raise InvalidSamplingParams(f"top_k must be an integer >= 0 (0 = off); got {k}")
        if p is not None and not (0 < p <= 1):
            raise InvalidSamplingParams(f"top_p must be in (0, 1]; got {p}")
        if m is not None and (not isinstance(m, int) or m < 1):
            raise InvalidSamplingParams(f"max_tokens must be an integer >= 1; got {m}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidSamplingParams(f"seed must be an integer; got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed; got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidSamplingParams("stop strings must be non-empty strings")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2 <= value <= 2):
                raise InvalidSamplingParams(f"{name} must be in [-2, 2]; got {value}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS):
            raise InvalidSamplingParams(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] "
                                        f"(alternatives per token); got {n!r}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 < r <= 10):
            raise InvalidSamplingParams(f"repetition_penalty must be in (0, 10] (1 = off); got {r}")

    def resolve(self, defaults: GenerationDefaults | None, max_tokens_cap: int) -> SamplingParams:
        """Every unset field filled: from `defaults` when given, else neutral values.

        max_tokens falls back to the model default, clamped to `max_tokens_cap` (the room left
        in the request's context), or to the cap itself."""
        def pick(value, name, neutral):
            if value is not None:
                return value
            model_value = getattr(defaults, name, None) if defaults is not None else None
            return neutral if model_value is None else model_value

        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = min(pick(None, "max_tokens", max_tokens_cap), max_tokens_cap)
        return replace(self, temperature=float(pick(self.temperature, "temperature", 1.0)),
                       top_k=int(pick(self.top_k, "top_k", 0)),
                       top_p=float(pick(self.top_p, "top_p", 1.0)), max_tokens=max_tokens)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0   # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model (before temperature and penalties)
    and the `top` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one step produced for one request. The last output has finish_reason set.

    finish_reason: "stop" (EOS or a stop string), "length" (max_tokens), "abort", "error".
    stop_reason: the stop string that matched, or the EOS token id, when finish_reason is "stop".
    """

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage
    stop_reason: str | int | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token_ids entry, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStatus(Enum):
    WAITING = "waiting"    # no KV pages yet (new, or preempted and due for recompute)
    RUNNING = "running"    # holds KV pages: prefilling in chunks or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence. token_ids = prompt + generated; the first num_computed have KV in `pages`.
    While steps are in flight (overlap scheduling), its last one or two ids are placeholders
    (< 0) for tokens still on the device; only the first num_computed - 1 are always known."""

    request_id: str
    prompt_len: int
    token_ids: list[int]
    params: SamplingParams                       # resolved: no None fields except seed
    generator: np.random.Generator
    detokenizer: IncrementalDetokenizer
    sink: Callable[[RequestOutput], None]
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    guide: Guide | None = None                   # grammar / thinking budget, when asked for
    page_keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of full pages
    num_published: int = 0           # leading pages already offered to the prefix cache
    cached_tokens: int | None = None  # prompt tokens reused at first admission
    state_slot: int = -1             # hybrid models: its recurrent-state slot while running
    turn_snapshot: bytes | None = None   # hybrid models: key of its latest end-of-turn snapshot
    # hybrid models with overlap: (tokens covered, row) of a snapshot copied, not yet keyed
    staged_snapshot: tuple[int, int] | None = None
    # prepare.py's int32 copy of `pages`: (the list it copies, the array, entries copied). The
    # scheduler only appends to a pages list or replaces it, so the copy stays valid.
    page_rows: tuple | None = field(default=None, repr=False)
    mm: Any = None   # engine/multimodal.py's MultimodalPrompt when the prompt has images
    inject_fault: bool = False   # tests (engine/faults.py): its step raises before the forward
    draft_state: Any = None   # engine/speculative.py's DraftState once it has drafted

    @property
    def key_ids(self):
        """token_ids as prefix-cache keys hash them (image placeholders stand for the image)."""
        return self.token_ids if self.mm is None else self.mm.key_tokens(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet: 1 while decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def usage(self) -> Usage:
        return Usage(self.prompt_len, self.num_output, self.cached_tokens or 0)
