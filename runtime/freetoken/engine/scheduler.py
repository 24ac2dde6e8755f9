"""Continuous batching: every step decodes all running sequences and prefills waiting ones in
chunks under a token budget, admitting new sequences only while KV pages are available."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from freetoken.engine.config import EngineConfig
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its num_computed, run in this step."""

    request: Request
    num_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so its logits are sampled."""
        return self.request.num_computed + self.num_tokens == len(self.request.token_ids)


class Scheduler:
    """Owns the waiting queue and the running list; not thread-safe (the engine holds a lock).

    Policy per step: running sequences first, oldest first (a decode costs one token and is
    always scheduled; a chunked prefill in progress takes from the prefill budget), then waiting
    sequences in arrival order while the budget, max_num_seqs and free pages allow. When a
    running sequence needs a page and none is free, the newest running sequence is preempted:
    its pages are freed and it goes back to the head of the queue to be recomputed later.
    """

    def __init__(self, config: EngineConfig, pool: PagePool):
        self.config = config
        self.pool = pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Drop a request from either queue and free its pages at once (finish or abort)."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        """The work for one step (possibly empty)."""
        plan: list[ScheduledChunk] = []
        budget = self.config.max_prefill_tokens
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            want = request.num_pending
            size = 1 if want == 1 else min(want, budget)
            if size == 0 or not self._reserve(request, request.num_computed + size):
                continue
            plan.append(ScheduledChunk(request, size))
            budget -= 0 if want == 1 else size
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            size = min(request.num_pending, budget)
            if not self._admit(request, size):
                break
            plan.append(ScheduledChunk(request, size))
            budget -= size
        return plan

    def owned_pages(self) -> list[list[int]]:
        return [r.pages for r in self.running]

    def _admit(self, request: Request, num_tokens: int) -> bool:
        # Keep one spare page per running sequence so admitting does not force a preemption
        # on the very next decode step.
        needed = -(-num_tokens // self.pool.block_size) + len(self.running)
        if not self.pool.can_allocate(needed) or not self.pool.extend(request.pages, num_tokens):
            return False
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        return True

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` tokens of a running request, preempting newer ones if needed.
        False when the request itself had to be preempted."""
        while not self.pool.extend(request.pages, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        self.pool.free(request.pages)
        request.pages = []
        request.num_computed = 0
