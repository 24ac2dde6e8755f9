"""What one load level measured: per-request timings from the stream's chunk times, and their
summary (rates, TTFT / TPOT / ITL percentiles, goodput under a latency target, errors by kind).

Times are seconds on the client's monotonic clock. A request's output tokens are the server's
own count (usage.completion_tokens) where it sends one, else the content chunks it streamed:
a chunk usually carries one token, but a token that ends mid-character streams nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. `error` is None for a complete stream."""

    index: int
    sent: float                                            # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # each content chunk's arrival
    ended: float | None = None
    prompt_tokens: int | None = None       # usage.prompt_tokens (chat template included)
    completion_tokens: int | None = None   # usage.completion_tokens
    asked_tokens: int = 0                  # max_tokens sent
    error: str | None = None               # the error's kind: http_503, timeout, stream_error...
    detail: str = ""                       # the first error's message, for the log

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        return (self.completion_tokens if self.completion_tokens is not None
                else len(self.chunk_times))

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        tokens = self.output_tokens
        if tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (tokens - 1)

    @property
    def itls(self) -> list[float]:
        """The gaps between consecutive content chunks."""
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def spread(values: list[float]) -> dict:
    """{"p50", "p90", "p99", "mean"} of `values` (None each when empty)."""
    out = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def meets_target(record: RequestRecord, ttft_slo: float | None,
                 tpot_slo: float | None) -> bool:
    """Whether a complete request met the latency target (a missing target always holds;
    a one-token reply has no TPOT to miss)."""
    if not record.ok or record.ttft is None:
        return False
    if ttft_slo is not None and record.ttft > ttft_slo:
        return False
    tpot = record.tpot
    return tpot_slo is None or tpot is None or tpot <= tpot_slo


def summarize(records: list[RequestRecord], ttft_slo: float | None = None,
              tpot_slo: float | None = None) -> dict:
    """The level's figures. Duration runs from the first request sent to the last one ended,
    so rates count only the time the server had work.

    Args:
        records: every request of the level, complete or not.
        ttft_slo, tpot_slo: the latency target in seconds for goodput (None: no bound).
    Returns:
        a JSON-ready dict; times in seconds, rates per second.
    """
    done = [r for r in records if r.ok]
    ends = [r.ended for r in records if r.ended is not None]
    duration = (max(ends) - min(r.sent for r in records)) if ends else 0.0
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    output = sum(r.output_tokens for r in done)
    good = [r for r in done if meets_target(r, ttft_slo, tpot_slo)]
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {
        "requests": len(records), "completed": len(done),
        "errors": dict(Counter(r.error for r in records if not r.ok)),
        "error_examples": {r.error: r.detail for r in reversed(records) if not r.ok},
        "short_outputs": sum(1 for r in done if r.output_tokens < r.asked_tokens),
        "duration_s": duration,
        "requests_per_s": per_s(len(done)),
        "output_tok_per_s": per_s(output),
        "output_tokens": output,
        "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        "ttft_s": spread([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": spread([r.tpot for r in done if r.tpot is not None]),
        "itl_s": spread([gap for r in done for gap in r.itls]),
        "latency_s": spread([r.latency for r in done if r.latency is not None]),
        "goodput": {"ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "met": len(good),
                    "requests_per_s": per_s(len(good)),
                    "fraction": len(good) / len(records) if records else None},
    }
