"""Overlap scheduling: the host prepares step N+1 while the device runs step N.

A step whose sampled rows need nothing from the host between logits and token (no penalties,
logprobs or grammar guide) is launched without waiting: forward, sampling into a device token
array, and a copy of that array back to the host started at once. While it runs, a next step
that only decodes is scheduled and launched: each sequence's next input id is not known yet, so
the host writes a placeholder, -(1 + row), and the device fills it from step N's token array
before the forward. Only then does the host wait for step N's ids (the one wait per step) and
run its stop checks; a sequence that stopped at N had one more token computed at N+1, which is
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken.arrays import is_torch
from freetoken.engine.request import Request
from freetoken.engine.scheduler import ScheduledChunk


def placeholder(row: int) -> int:
    """The input id that stands for row `row` of the previous step's sampled tokens."""
    return -1 - row


def overlap_safe(request: Request) -> bool:
    """True when sampling the request's next token needs no host work on its logits (and so
    its token can stay on the device until the step after has been launched)."""
    params = request.params
    # a request marked for an injected fault (engine/faults.py) takes the synchronous step,
    # where the fault is raised
    return (not params.has_penalties and params.logprobs is None and request.guide is None
            and not request.inject_fault)


def fill_placeholders(input_ids: Any, previous: Any) -> Any:
    """`input_ids` with every placeholder -(1 + row) replaced by previous[row], computed on
    the ids' device (queued behind the step that samples `previous`: no host wait)."""
    if previous is None or previous.shape[0] == 0:
        return input_ids    # nothing sampled: no placeholders can refer to it
    if is_torch(input_ids):
        import torch

        rows = (-1 - input_ids).clamp_(min=0)    # real ids read row 0, then are kept as is
        filled = torch.index_select(previous, 0, rows).to(input_ids.dtype)
        return torch.where(input_ids < 0, filled, input_ids)
    rows = np.maximum(-1 - input_ids, 0)
    return np.where(input_ids < 0, previous[rows], input_ids)


class TokenReadback:
    """A step's sampled ids on their way to the host: the copy is queued at once, behind the
    sampling, so `ids()` waits for this step only, not for the step launched after it."""

    def __init__(self, tokens: Any):
        self.device_tokens = tokens
        self._host, self._event = tokens, None
        if is_torch(tokens) and tokens.is_cuda:
            import torch

            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def ids(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return [int(t) for t in self._host.tolist()]


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read yet.

    sampled: (request, index in its token_ids of the placeholder for its new token), in the
        order of the rows of `tokens`.
    """

    plan: list[ScheduledChunk]
    sampled: list[tuple[Request, int]]
    tokens: TokenReadback

    def known_tokens(self) -> dict[int, int]:
        """id(request) -> how many leading token ids are real (the rest wait for this step)."""
        return {id(request): index for request, index in self.sampled}
