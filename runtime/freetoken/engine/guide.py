"""Per-request decoding rules applied to the logits before sampling: a grammar and a thinking
budget.

A request's Guide restricts which tokens may come next. Its grammar mask for step n+1 is
computed on a worker thread right after step n's token is known, so it overlaps the forward
pass of step n+1 instead of adding to it; the sampler waits for it only when it is not ready.

Thinking: while the model reasons (after `<think>`, or from the start when the prompt opened
the block), the grammar is off; when the reasoning reaches the budget, the guide forces the
tokens that close the block, so the answer follows within max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from freetoken.arrays import is_torch

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"

_executor: ThreadPoolExecutor | None = None


def mask_executor() -> ThreadPoolExecutor:
    """One worker for every mask: matchers are advanced in token order, off the engine
    thread."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="freetoken-mask")
    return _executor


class TokenMatcher(Protocol):
    def consume(self, token_id: int) -> bool: ...

    def allowed(self) -> np.ndarray | None: ...


@dataclass(frozen=True)
class ThinkRule:
    """open_id: the token that opens reasoning (None: the model never opens it itself);
    close_ids: what closes it (forced when the budget is spent, ending with the close token);
    budget: most reasoning tokens (None: unlimited); in_thinking: the prompt opened it."""

    open_id: int | None
    close_ids: tuple[int, ...]
    budget: int | None = None
    in_thinking: bool = False


class Guide:
    """What one request may sample next. Call `start()` once, `restrict(row)` before each
    sampling step, `accept(token)` after it."""

    def __init__(self, matcher: TokenMatcher | None = None, think: ThinkRule | None = None):
        self.matcher = matcher
        self.think = think
        self.phase = ANSWER
        if think is not None:
            self.phase = THINKING if think.in_thinking else (BEFORE if think.open_id is not None
                                                             else ANSWER)
        self.reasoning_tokens = 0
        self.forced: list[int] = []
        self._pending: Future | None = None

    def start(self) -> Guide:
        if self.matcher is not None:
            self._pending = mask_executor().submit(self._bias, self.phase == BEFORE)
        return self

    def bias(self, vocab: int) -> np.ndarray | None:
        """float32 [vocab] to add to the logits (0 = allowed, -inf = not), or None when
        anything goes."""
        if self.forced:
            only = np.full(vocab, -np.inf, dtype=np.float32)
            only[self.forced[0]] = 0.0
            return only
        if self.matcher is None or self.phase == THINKING or self._pending is None:
            return None
        bias = self._pending.result()
        return None if bias is None or bias.shape[0] != vocab else bias

    def _bias(self, open_allowed: bool) -> np.ndarray | None:
        """Runs on the mask worker: the grammar's mask as an additive bias, so the engine
        thread only adds it."""
        allowed = self.matcher.allowed()
        if allowed is None or not allowed.any():
            return None
        bias = np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        if open_allowed:
            bias[self.think.open_id] = 0.0
        return bias

    def accept(self, token: int) -> None:
        """Advance past the sampled token; the next grammar mask starts computing now."""
        forced = bool(self.forced) and token == self.forced[0]
        if forced:
            self.forced.pop(0)
        if self.phase == BEFORE:
            self.phase = THINKING if token == self.think.open_id else ANSWER
            if self.phase == THINKING:
                return
        elif self.phase == THINKING:
            self._think_step(token, forced)
            return
        if self.matcher is not None:
            self._pending = mask_executor().submit(self._advance, token)

    def _advance(self, token: int) -> np.ndarray | None:
        return self._bias(False) if self.matcher.consume(token) else None

    def _think_step(self, token: int, forced: bool) -> None:
        rule = self.think
        if token == rule.close_ids[-1]:
            self.phase, self.forced = ANSWER, []
            if self.matcher is not None:
                self._pending = mask_executor().submit(self._bias, False)
            return
        self.reasoning_tokens += 0 if forced else 1
        if rule.budget is not None and self.reasoning_tokens >= rule.budget and not self.forced:
            self.forced = list(rule.close_ids)


def apply_guides(logits, guides: Sequence[Guide | None]) -> None:
    """In place on float32 logits [B, V] (numpy, or torch on a GPU): tokens a guide forbids get
    -inf, so every sampler (greedy, top-k, top-p) picks among the allowed ones."""
    vocab = logits.shape[-1]
    for row, guide in enumerate(guides):
        bias = guide.bias(vocab) if guide is not None else None
        if bias is None:
            continue
        if is_torch(logits):
            import torch

            logits[row] += torch.from_numpy(bias).to(logits.device, non_blocking=True)
        else:
            logits[row] += bias
