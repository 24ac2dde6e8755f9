"""The engine thread's speculative steps (engine/speculative.py): drafting set up at start,
verification of a step's drafts, a hybrid model's state rollback (engine/state_rollback.py),
and the MTP block's step after each target step (engine/mtp_drafts.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from freetoken.engine.config import EngineConfigError
from freetoken.engine.mtp_drafts import BlockRows, MTPDrafts
from freetoken.engine.prepare import prepare_forward_batch
from freetoken.engine.sampling import greedy_tokens
from freetoken.engine.scheduler import ScheduledChunk
from freetoken.engine.speculative import (VERIFY_MAX_BATCH, Drafter, Governor,
                                          accept_greedy, speculation_blocker, verify)
from freetoken.engine.state_rollback import MAX_DRAFTING_HYBRID, SavedStates

logger = logging.getLogger("freetoken.engine")


class SpeculativeSteps:
    """Engine methods for speculative decoding; they use the engine's model, KV pool, states,
    scheduler, pool, drafter and its _append_token."""

    def _set_up_speculation(self, model: Any) -> None:
        """The drafter (and the MTP block's pool) where this model and engine allow drafts;
        speculation_off_because says why not. Raises EngineConfigError for --speculative mtp
        on a model without the block."""
        self.drafter, self.speculation_off_because, self.mtp = None, None, None
        self._linear_layers = [i for i in range(model.config.num_layers)
                               if model.config.is_linear(i)]
        if self.config.speculative == "off":
            return
        has_mtp = getattr(model, "mtp", None) is not None
        if self.config.speculative == "mtp" and not has_mtp:
            raise EngineConfigError(
                "--speculative mtp: this model has no multi-token-prediction block (no mtp.* "
                "tensors in the checkpoint); use --speculative ngram or auto")
        self.speculation_off_because = speculation_blocker(self)
        if self.speculation_off_because is not None:
            if self.config.speculative != "auto":
                logger.warning("speculative decoding is off: %s", self.speculation_off_because)
            return
        method = "mtp" if has_mtp and self.config.speculative != "ngram" else "ngram"
        self.drafter = Drafter(self.config.num_speculative_tokens, method)
        self.scheduler.drafter = self.drafter.draft
        if self.config.speculative == "auto":   # drafting only where it measures faster
            self.scheduler.governor = Governor()
        if method == "mtp":
            self.mtp = MTPDrafts(model, self.kv.num_blocks, self.kv.block_size, self.kv_dtype,
                                 self.config.num_speculative_tokens)
        if self.states is not None:   # each drafting sequence's states are copied
            self.scheduler.max_drafting = MAX_DRAFTING_HYBRID
        if not self.arrays.device.is_cpu and self.config.cuda_graphs:
            # wider steps would verify eagerly, slower than plain decoding's graphs
            self.scheduler.max_drafting = min(self.scheduler.max_drafting or VERIFY_MAX_BATCH,
                                              VERIFY_MAX_BATCH)

    def _verify_graph_shape(self) -> tuple[int, int]:
        """(K, the most tokens a step may take) for the verify CUDA graphs; (0, 0) without
        drafting."""
        if self.drafter is None:
            return 0, 0
        return (self.config.num_speculative_tokens,
                self.config.max_prefill_tokens + self.config.max_num_seqs)

    def _save_drafting_states(self, plan: list[ScheduledChunk]) -> SavedStates | None:
        """A hybrid model's states of the sequences verifying drafts this step (rolled back
        where a draft is rejected); None when no sequence drafts or the model has none."""
        if self.states is None or not any(chunk.draft for chunk in plan):
            return None
        return SavedStates(self.kv, self._linear_layers,
                           [c.request.state_slot for c in plan if c.draft], self.arrays)

    def _speed_mark(self, plan: list[ScheduledChunk]) -> tuple[int, float] | None:
        """--speculative auto, a decode step (every chunk a last token and its drafts): its
        tokens so far and start time, for _record_speed; None otherwise."""
        if self.scheduler.governor is None or any(c.num_tokens != 1 + len(c.draft)
                                                  for c in plan):
            return None
        return sum(len(c.request.token_ids) for c in plan), time.perf_counter()

    def _record_speed(self, plan: list[ScheduledChunk], emitted_before: int,
                      started: float) -> None:
        """Give the governor a decode step's tokens and seconds, under the mode the step ran
        in (drafting allowed: the MTP block ran, and requests whose drafting is paused
        decoded one token), whether or not a request drafted."""
        emitted = sum(len(c.request.token_ids) for c in plan) - emitted_before
        self.scheduler.governor.record(len(plan), self.scheduler.drafting, emitted,
                                       time.perf_counter() - started,
                                       proposed=sum(len(c.draft) for c in plan))

    def _block_rows(self, plan: list[ScheduledChunk], accepted: dict) -> list[BlockRows]:
        """What the MTP block runs over after this step (engine/mtp_drafts.py): per live
        sequence the positions it computed whose next token is known now (a verify step's
        accepted ones), with their rows of the target's hidden states."""
        parts, row = [], 0
        for chunk in plan:
            request, first = chunk.request, row
            row += chunk.num_tokens
            if request.is_finished or request.mm is not None:
                continue
            count = 1 + accepted[id(chunk)] if chunk.draft else chunk.num_tokens
            start = request.num_computed - count
            if len(request.token_ids) > request.num_computed:   # its next token is known
                parts.append(BlockRows(request, start, count, range(first, first + count)))
        return parts

    def _verify(self, chunks: list[ScheduledChunk], logits: Any,
                first_rows: list[int]) -> tuple[list[ScheduledChunk], dict[int, int]]:
        """Keep each chunk's accepted drafts and the target's next token (engine/
        speculative.py). Returns the chunks of a hybrid model whose states must be rolled back
        to the accepted tokens (engine/state_rollback.py) and the accepted count per chunk
        (by id). Greedy rows are read back as argmax ids (one transfer); sampled rows as
        logits, sampled on the host."""
        index = [r for chunk, first in zip(chunks, first_rows)
                 for r in range(first, first + 1 + len(chunk.draft))]
        rows = logits[index] if len(index) < logits.shape[0] else logits
        with self.arrays.no_grad():
            targets = greedy_tokens(rows)
            host = None
            if any(chunk.request.params.temperature > 0 for chunk in chunks):
                host = rows.float().cpu().numpy() if hasattr(rows, "cpu") else rows
        at, replay, accepted_by_chunk = 0, [], {}
        for chunk in chunks:
            request, n = chunk.request, 1 + len(chunk.draft)
            params = request.params
            tokens = (verify(host[at:at + n], chunk.draft, params, request.generator)
                      if params.temperature > 0 else accept_greedy(targets[at:at + n], chunk.draft))
            at += n
            accepted = accepted_by_chunk[id(chunk)] = len(tokens) - 1
            self.drafter.record(request, len(chunk.draft), accepted)
            request.num_computed += 1 + accepted
            for token in tokens:
                if request.is_finished:
                    break
                self._append_token(request, token)
            if self.states is not None and accepted < len(chunk.draft) \
                    and not request.is_finished:
                replay.append(ScheduledChunk(request, 1 + accepted))
        return replay, accepted_by_chunk

    def _replay(self, chunks: list[ScheduledChunk], saved: SavedStates) -> None:
        """Restore the states saved before the verify step and run each sequence's accepted
        tokens again (its last token and accepted drafts), so the states stand after them."""
        saved.restore([chunk.request.state_slot for chunk in chunks])
        for chunk in chunks:
            chunk.request.num_computed -= chunk.num_tokens
        batch = prepare_forward_batch(chunks, self.pool.block_size, self.arrays, True)
        with self.arrays.no_grad():
            self.model.forward(batch, self.kv)
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_tokens
        self.drafter.stats.replays += len(chunks)
