"""The engine thread's overlapped steps (engine/overlap.py): launch a step without waiting,
launch the next decode-only step on placeholder ids, then read and process the first."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from freetoken.engine.overlap import (InFlight, TokenReadback, fill_placeholders, overlap_safe,
                                      placeholder)
from freetoken.engine.prepare import prepare_forward_batch
from freetoken.engine.sampling import sample_on_device
from freetoken.engine.scheduler import ScheduledChunk
from freetoken.engine.stream import batched_delivery
from freetoken.models.batch import ForwardBatch

logger = logging.getLogger("freetoken.engine")


class OverlapSteps:
    """Engine methods for overlap scheduling; they use the engine's model, graphs, scheduler,
    pool, lock (_cond) and its _append_token, _fail and counters."""

    def _overlaps(self, plan: list[ScheduledChunk]) -> bool:
        # a step that lets requests draft runs synchronously (the MTP block follows it)
        return (self.overlap and not self.scheduler.drafting
                and all(overlap_safe(chunk.request) for chunk in plan))

    def _advance(self, in_flight: InFlight) -> InFlight | None:
        """Launch the next step when it only decodes, then read and process `in_flight`'s
        tokens; the launched step (or None: the next one is scheduled once nothing runs)."""
        with self._cond:
            work = None
            if not self._stopping and not self._jobs:
                plan = self.scheduler.schedule_decodes()
                if plan and self._overlaps(plan):
                    work = plan, prepare_forward_batch(plan, self.pool.block_size, self.arrays,
                                                       self.states is not None)
        launched = None
        if work is not None:
            # a step that sampled nothing (prefill chunks only) left no placeholders
            previous = in_flight.tokens.device_tokens if in_flight.sampled else None
            launched = self._launch(*work, previous=previous)
        self._resolve(in_flight)
        self._time_plain_step(in_flight, chained=launched is not None)
        if launched is None:
            with self._cond:
                if not self.scheduler.has_work:
                    self.pool.check_integrity(self.scheduler.owned_pages())
        return launched

    def _time_plain_step(self, in_flight: InFlight, chained: bool) -> None:
        """--speculative auto: an overlapped decode step's tokens and its period (from the
        previous step's tokens to its own, while the steps before and after it keep the
        pipeline full) are what plain decoding gives; the governor compares drafting steps
        with them. The last step of a run is left out: its period is not one step's (on the
        CPU, where a launch computes the step, it is nearly nothing)."""
        governor = self.scheduler.governor
        if governor is None:
            return
        now, last = time.perf_counter(), self._plain_resolved_at
        self._plain_resolved_at = now if chained else None
        if chained and last is not None and all(c.num_tokens == 1 and not c.draft
                                                for c in in_flight.plan):
            governor.record(len(in_flight.plan), False, len(in_flight.sampled), now - last)

    def _launch(self, plan: list[ScheduledChunk], batch: ForwardBatch,
                previous: Any = None) -> InFlight | None:
        """Queue the forward and the sampling of `plan` without waiting for either; each
        sampled request gets a placeholder for its new token. None when the launch failed."""
        rows = [i for i, chunk in enumerate(plan)
                if chunk.completes_sequence and not chunk.request.is_finished]
        requests = [plan[i].request for i in rows]
        try:
            with self.arrays.no_grad():
                if self.graphs is not None and self.graphs.can_run(batch):
                    logits = self.graphs.run(batch, previous)   # fills placeholders itself
                else:
                    if previous is not None:
                        batch.input_ids = fill_placeholders(batch.input_ids, previous)
                    logits = self.model.forward(batch, self.kv)
                if len(rows) < logits.shape[0]:
                    logits = logits[self.arrays.index(np.asarray(rows, dtype=np.int64))]
                tokens = TokenReadback(sample_on_device(
                    logits, [r.params for r in requests], [r.generator for r in requests]))
        except Exception as exc:  # a failed step fails its requests, not the server
            logger.exception("engine step failed")
            self._fail(plan, f"model step failed: {exc}")
            return None
        with self._cond:
            for chunk in plan:
                if not chunk.request.is_finished:
                    chunk.request.num_computed += chunk.num_tokens
            sampled = []
            for row, request in enumerate(requests):
                request.token_ids.append(placeholder(row))
                sampled.append((request, len(request.token_ids) - 1))
        return InFlight(plan, sampled, tokens)

    def _resolve(self, in_flight: InFlight) -> None:
        """Wait for a launched step's tokens, then publish pages, stream and stop as _process
        does; a request that ended meanwhile drops its token."""
        with batched_delivery():
            try:
                ids = in_flight.tokens.ids()
            except Exception as exc:
                logger.exception("engine step failed")
                self._fail(in_flight.plan, f"model step failed: {exc}")
                return
            with self._cond:
                self._counters["steps"] += 1
                known = in_flight.known_tokens()
                for chunk in in_flight.plan:
                    self.scheduler.publish(chunk.request, known.get(id(chunk.request)))
                for (request, index), token in zip(in_flight.sampled, ids):
                    if not request.is_finished:
                        self._append_token(request, token, index=index)
