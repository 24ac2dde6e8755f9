"""What the engine admits: a request that fits the context and the KV pool (check_request),
while the bounded waiting queue in front of the scheduler has room (AdmissionGate). Shutdown
closes the gate before it drains, so nothing new starts while the running requests finish."""

from __future__ import annotations

from freetoken.engine.request import PromptTooLong, RequestRejected, SamplingParams

# Seconds a refused client is told to wait (the Retry-After header): about one decode batch
# turning over on a busy server, short enough that a retry soon finds room.
RETRY_AFTER_S = 1
REFUSAL_REASONS = ("queue_full", "shutting_down")


class AdmissionRefused(RuntimeError):
    """The engine takes no request now (its queue is full, or it is shutting down); the
    caller may retry after `retry_after_s` seconds. `reason` is one of REFUSAL_REASONS."""

    def __init__(self, message: str, reason: str, retry_after_s: int = RETRY_AFTER_S):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class AdmissionGate:
    """Bounds the requests inside the engine (running plus waiting) at `max_num_seqs +
    max_queued_requests`: a request past that is refused at once instead of waiting without
    bound. Not thread-safe: the engine calls it with its lock held."""

    def __init__(self, max_num_seqs: int, max_queued_requests: int):
        self.max_queued_requests = max_queued_requests
        self.limit = max_num_seqs + max_queued_requests
        self.is_open = True
        self.refused = dict.fromkeys(REFUSAL_REASONS, 0)

    def admit(self, num_in_engine: int) -> None:
        """Raise AdmissionRefused (and count it) unless one more request may enter."""
        if not self.is_open:
            self._refuse("the server is shutting down and takes no new requests",
                         "shutting_down")
        if num_in_engine >= self.limit:
            self._refuse(f"the server is overloaded: {num_in_engine} requests are running or "
                         f"queued (at most {self.limit}: --max-num-seqs plus "
                         f"--max-queued-requests); retry later", "queue_full")

    def close(self) -> None:
        """Refuse every request from now on (shutdown)."""
        self.is_open = False

    def stats(self) -> dict[str, int | bool]:
        return {"max_queued_requests": self.max_queued_requests,
                "accepting_requests": self.is_open,
                **{f"requests_refused_{reason}": n for reason, n in self.refused.items()}}

    def _refuse(self, message: str, reason: str) -> None:
        self.refused[reason] += 1
        raise AdmissionRefused(message, reason)


def check_request(prompt: list[int], params: SamplingParams, limit: int, vocab: int,
                  detail: str) -> None:
    """Raise RequestRejected unless the prompt and max_tokens fit in `limit` tokens."""
    if not prompt:
        raise RequestRejected("the prompt is empty")
    if any(not 0 <= t < vocab for t in prompt):
        raise RequestRejected(f"the prompt holds token ids outside the vocabulary [0, {vocab})")
    if len(prompt) >= limit:
        raise PromptTooLong(f"the prompt has {len(prompt)} tokens; {detail}, and at least "
                            "one must be left for the output: shorten the prompt")
    if params.max_tokens is not None and len(prompt) + params.max_tokens > limit:
        raise PromptTooLong(
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
            f"the limit; {detail}: lower max_tokens or shorten the prompt")
