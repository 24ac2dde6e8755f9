"""Continuous batching: every step decodes all running sequences and prefills waiting ones in
chunks under a token budget, admitting new sequences only while KV pages are available. With
the prefix cache on, a sequence is admitted with the cached pages of its longest cached prefix
and prefills only the rest."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from freetoken.engine.config import EngineConfig
from freetoken.engine.kv_pool import PagePool, pages_for
from freetoken.engine.prefix_cache import extend_keys, root_key
from freetoken.engine.request import Request, RequestStatus
from freetoken.engine.state_pool import StateSlots
from freetoken.engine.state_snapshots import StateSnapshots


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at its num_computed, run in this step. A
    decode with `draft` tokens (engine/speculative.py) runs its last token and the drafts:
    num_tokens = 1 + len(draft), and every one of them gives logits."""

    request: Request
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so its logits are sampled."""
        return (self.request.num_computed + self.num_tokens
                == len(self.request.token_ids) + len(self.draft))


class Scheduler:
    """Owns the waiting queue and the running list; not thread-safe (the engine holds a lock).

    Policy per step: running sequences first, oldest first (a decode costs one token and is
    always scheduled; a chunked prefill in progress takes from the prefill budget), then waiting
    sequences in arrival order while the budget, max_num_seqs and free pages allow. When a
    running sequence needs a page and none is free, the newest running sequence is preempted:
    its pages are freed and it goes back to the head of the queue to be recomputed later.
    """

    def __init__(self, config: EngineConfig, pool: PagePool, model_id: str = "",
                 states: StateSlots | None = None):
        self.config = config
        self.pool = pool
        # hybrid models: a recurrent-state slot per running sequence; a GDN layer cannot resume
        # from cached KV pages alone, only from a state snapshot (else: recompute from start)
        self.states = states
        self.snapshots: StateSnapshots | None = None   # set by the engine with the prefix cache
        # speculative decoding: (request, most tokens) -> draft tokens (engine/speculative.py)
        self.drafter: Callable[[Request, int], tuple[int, ...]] | None = None
        # drafts only in steps of at most this many decoding sequences (None: any number)
        self.max_drafting: int | None = None
        # --speculative auto: whether a step drafts, from measured speed (speculative.Governor)
        self.governor = None
        self.drafting = False   # whether the last schedule() let its decodes draft
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.root = root_key(model_id) if config.prefix_cache else None
        self.cache_queried_tokens = 0   # prompt tokens of admitted requests
        self.cache_hit_tokens = 0       # of which served from the prefix cache

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._touch_snapshot(request)

    def _touch_snapshot(self, request: Request) -> None:
        """Count the snapshot a waiting hybrid request will resume from as used now. Requests
        arrive in bursts (retries, several agents' next turns) and are admitted over several
        steps: the first ones' new snapshots would otherwise evict, least recently used first,
        the very snapshots the later ones came for, rather than stale ones."""
        if self.snapshots is None or self.root is None:
            return
        keys = extend_keys(request.page_keys, request.key_ids, len(request.token_ids) - 1,
                           self.pool.block_size, self.root)
        for key in reversed(keys):
            if self.snapshots.touch(key):
                return

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
        drafter = self.drafter
        if drafter is not None:
            decoding = sum(r.num_pending == 1 for r in self.running)
            if not self._may_draft(decoding) or (
                    self.governor is not None and not self.governor.allows(decoding)):
                drafter = None
        self.drafting = drafter is not None
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            want = request.num_pending
            draft = ()
            if want == 1 and drafter is not None:
                draft = drafter(request, budget)
            size = 1 + len(draft) if want == 1 else self._clip(request, min(want, budget))
            if size == 0 or not self._reserve(request, request.num_computed + size):
                continue
            plan.append(ScheduledChunk(request, size, draft))
            budget -= len(draft) if want == 1 else size
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0 \
                and (self.states is None or self.states.num_free):
            request = self.waiting[0]
            size = self._admit(request, budget)
            if not size:
                break
            plan.append(ScheduledChunk(request, size))
            budget -= size
        return plan

    def schedule_decodes(self) -> list[ScheduledChunk] | None:
        """The next step while the current one is still running (overlap scheduling): every
        running sequence decodes one token. None when that step would do anything else: admit
        a waiting request, continue a prefill or preempt (the caller then waits for the
        current step and calls schedule()). Where publishing the running step will snapshot
        a hybrid request's states, they are copied here, queued before the next step changes
        them, and keyed when that step is published (its tokens are known then)."""
        if not self.running or (self.waiting and len(self.running) < self.config.max_num_seqs):
            return None
        if any(request.num_pending != 1 for request in self.running):
            return None
        if self.drafter is not None:   # --speculative auto while its governor says plain
            decoding = len(self.running)
            if self.governor is None or (self._may_draft(decoding)
                                         and self.governor.would_allow(decoding)):
                return None            # a drafting step: schedule() builds it
            if self._may_draft(decoding):
                self.governor.allows(decoding)   # counts the step towards its next probe
        for request in self.running:
            if not self.pool.extend(request.pages, request.num_computed + 1):
                return None
        self.drafting = False
        for request in self.running:
            done = request.num_computed
            if self._snapshot_due(request, done):
                self._discard_staged(request)
                row = self.snapshots.stage(request.state_slot,
                                           self._snapshot_replaces(request, done))
                request.staged_snapshot = (done, row)
        return [ScheduledChunk(request, 1) for request in self.running]

    def _may_draft(self, decoding: int) -> bool:
        """Whether a step of `decoding` decoding sequences is narrow enough to draft."""
        return self.max_drafting is None or decoding <= self.max_drafting

    def publish(self, request: Request, num_known: int | None = None) -> None:
        """Offer the request's full, computed pages to the prefix cache (after each step);
        with overlap scheduling only its first `num_known` token ids are known yet."""
        if self.root is None or request.is_finished:
            return
        done = request.num_computed if num_known is None else min(num_known,
                                                                   request.num_computed)
        keys = extend_keys(request.page_keys, request.key_ids, done, self.pool.block_size,
                           self.root)
        full = done // self.pool.block_size  # keys may run ahead (see _match)
        for j in range(request.num_published, full):
            self.pool.publish(request.pages[j], keys[j])
        request.num_published = max(request.num_published, full)
        staged = request.staged_snapshot
        if staged is not None and staged[0] <= done:   # copied by schedule_decodes
            request.staged_snapshot = None
            self._store_snapshot(request, keys, *staged)
            if staged[0] == done:
                return
        if self._snapshot_due(request, done):
            self._store_snapshot(request, keys, done, None)

    def _store_snapshot(self, request: Request, keys: list[bytes], at: int,
                        row: int | None) -> None:
        """Key the snapshot of the states after `at` tokens with that page's key: the `row`
        schedule_decodes staged, or (None) a copy made now. Past the prompt's snapshot point
        it is the turn's end, moved forward page by page (the request may stop at any token,
        so each full page replaces the previous one)."""
        key = keys[at // self.pool.block_size - 1]
        if row is None:
            self.snapshots.save(key, request.state_slot, self._snapshot_replaces(request, at))
        else:
            self.snapshots.commit(key, row)
        if at != self._snapshot_point(request):
            request.turn_snapshot = key

    def _snapshot_replaces(self, request: Request, at: int) -> bytes | None:
        """The stored snapshot whose row a snapshot after `at` tokens takes over: the request's
        previous turn end (none at the prompt's snapshot point)."""
        return None if at == self._snapshot_point(request) else request.turn_snapshot

    def _snapshot_due(self, request: Request, done: int) -> bool:
        """Whether publishing `done` computed tokens snapshots the request's states: at the
        prompt's snapshot point, then at each full page after it."""
        if self.snapshots is None:
            return False
        point = self._snapshot_point(request)
        return bool(point and done == point) or (done > point
                                                 and done % self.pool.block_size == 0)

    def _snapshot_point(self, request: Request) -> int:
        """Tokens after which a hybrid request's states are snapshotted: the prompt's last
        full page (the last prompt token is never cached: its logits are sampled); 0 = none."""
        if self.snapshots is None:
            return 0
        return (request.prompt_len - 1) // self.pool.block_size * self.pool.block_size

    def _clip(self, request: Request, size: int) -> int:
        """A prefill chunk cut to end at the snapshot point when it would run past it."""
        point = self._snapshot_point(request)
        if request.num_computed < point < request.num_computed + size:
            return point - request.num_computed
        return size

    def trim_pages(self, request: Request) -> None:
        """Free the pages past the request's known tokens (those held only rejected drafts)."""
        keep = pages_for(len(request.token_ids), self.pool.block_size)
        if len(request.pages) > keep:
            self.pool.free(reversed(request.pages[keep:]))
            del request.pages[keep:]

    def owned_pages(self) -> list[list[int]]:
        return [r.pages for r in self.running]

    def _admit(self, request: Request, budget: int) -> int:
        """Admit the head of the queue with its first chunk; the chunk's size, 0 if it waits."""
        self._match(request)
        size = self._clip(request, min(request.num_pending, budget))
        end = request.num_computed + size
        # Keep one spare page per running sequence so admitting does not force a preemption
        # on the very next decode step.
        needed = pages_for(end, self.pool.block_size) - len(request.pages) + len(self.running)
        if not self.pool.can_allocate(needed) or not self.pool.extend(request.pages, end):
            self._release(request)
            return 0
        self.waiting.popleft()
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        if self.states is not None:
            request.state_slot = self.states.allocate()
            if request.num_computed:     # resumed at a snapshot (see _match)
                page = request.num_computed // self.pool.block_size
                self.snapshots.restore(request.page_keys[page - 1], request.state_slot)
        if request.cached_tokens is None:  # first admission (not a recompute after preemption)
            request.cached_tokens = min(request.num_computed, request.prompt_len)
            self.cache_queried_tokens += request.prompt_len
            self.cache_hit_tokens += request.cached_tokens
        return size

    def _match(self, request: Request) -> None:
        """Start the request from the cached pages of its longest cached prefix. The last
        token is never taken from the cache: its forward gives the logits to sample from."""
        if self.root is None or request.pages:
            return
        keys = extend_keys(request.page_keys, request.key_ids, len(request.token_ids) - 1,
                           self.pool.block_size, self.root)
        request.pages = self.pool.match(keys)
        if self.states is not None:   # only as far as the latest state snapshot
            keep = len(request.pages)
            while keep and (self.snapshots is None or not self.snapshots.has(keys[keep - 1])):
                keep -= 1
            self.pool.free(reversed(request.pages[keep:]))
            del request.pages[keep:]
        request.num_computed = len(request.pages) * self.pool.block_size
        request.num_published = len(request.pages)

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
        self.pool.free(reversed(request.pages))  # tail first: it is evicted before the head
        request.pages = []
        request.num_computed = request.num_published = 0
        request.turn_snapshot = None   # a recompute starts over; the stored row stays valid
        self._discard_staged(request)
        if request.state_slot >= 0:
            self.states.free(request.state_slot)
            request.state_slot = -1

    def _discard_staged(self, request: Request) -> None:
        if request.staged_snapshot is not None:
            self.snapshots.discard(request.staged_snapshot[1])
            request.staged_snapshot = None
