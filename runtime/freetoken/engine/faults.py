"""Fault injection for tests (FREETOKEN_FAULT_MARKER): a request whose prompt text contains
the marker fails inside the engine step, before the forward, so tests can watch one request
fail in the engine while the others in the same batch go on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from freetoken.engine.request import Request
    from freetoken.engine.scheduler import ScheduledChunk


class RequestFault(RuntimeError):
    """A step failed because of `requests` alone: they end with finish_reason "error"; the
    step's other requests committed nothing and run again in the next step."""

    def __init__(self, requests: Sequence[Request], message: str):
        super().__init__(message)
        self.requests = list(requests)


def has_fault_marker(tokenizer: Any, prompt: list[int], marker: str | None) -> bool:
    """Whether the prompt's text contains the marker (never, when no marker is set)."""
    return bool(marker) and marker in tokenizer.decode(prompt, skip_special_tokens=False)


def raise_injected_faults(plan: list[ScheduledChunk]) -> None:
    """Raise RequestFault for the plan's marked requests (see Request.inject_fault)."""
    marked = [c.request for c in plan if c.request.inject_fault and not c.request.is_finished]
    if marked:
        raise RequestFault(marked, "injected fault: the prompt contains FREETOKEN_FAULT_MARKER")
