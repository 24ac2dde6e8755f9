"""Decode steps replayed from CUDA graphs captured once, at start, for fixed batch sizes.

A decode step of B sequences replays the graph of the smallest captured size >= B. Padding rows
store no KV (slot -1), attend to one slot of page 0 and their logits are dropped. Graphs hold raw
pointers: the model's work buffers must be reserved for the largest step before capture.

With overlap scheduling a step is launched before the previous one's tokens are read: its input
ids hold placeholders, and the graph itself fills them from a static copy of the previous step's
token array (engine/overlap.py) before the forward; real ids pass through unchanged.

Speculative decoding verifies K drafts per sequence: a verify step of B sequences is B * (K + 1)
tokens, every row's logits returned. With `max_draft` K > 0 a second set of graphs is captured
for those steps, for batch sizes up to VERIFY_MAX_BATCH. A sequence with fewer drafts is padded
to K + 1 tokens (slot -1: its padding stores no KV; a causal row never sees the rows after it),
except on a hybrid model, whose recurrent states would move past the padding: there a step
replays a verify graph only when every sequence drafted K tokens. The real rows' logits (and
hidden states, which the MTP block reads) are gathered back in the eager step's order.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken.engine.overlap import fill_placeholders
from freetoken.engine.speculative import VERIFY_MAX_BATCH
from freetoken.models.batch import ForwardBatch, KVCache

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Captured decode forwards; ``run`` copies a batch into the static inputs and replays."""

    def __init__(self, model, kv: KVCache, max_batch: int, max_blocks: int,
                 max_draft: int = 0, max_tokens: int | None = None):
        self.model, self.kv = model, kv
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.max_blocks = max_blocks
        self.max_draft = max_draft
        # verify graphs: sizes whose B * (K + 1) tokens fit the model's work buffers
        rows = max_draft + 1
        self.verify_sizes = [s for s in self.sizes if s <= VERIFY_MAX_BATCH
                             and (max_tokens is None or s * rows <= max_tokens)] \
            if max_draft else []
        n, dev = self.sizes[-1], model.arrays.torch_device
        t = max(n, rows * max(self.verify_sizes, default=0))
        # Static inputs (device tensors); views of their first rows feed each graph.
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.previous_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        # hybrid models: recurrent-state slots; -1 (padding) makes the GDN kernels skip a row
        self.state_slots = (torch.full((n,), -1, dtype=torch.int32, device=dev)
                            if kv.num_state_slots else None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}   # the model's last_hidden after each graph
        # verify graphs by batch size: sequence b owns rows b * (K + 1) ...
        self.verify_starts = torch.arange(0, t + 1, rows, dtype=torch.int32, device=dev)
        self.verify_rows = torch.arange(t, dtype=torch.int64, device=dev)
        self.verify_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.verify_outputs: dict[int, torch.Tensor] = {}
        self.verify_hidden: dict[int, torch.Tensor] = {}
        self.verify_replays = 0
        self.capture_seconds = 0.0

    def _static_batch(self, size: int) -> ForwardBatch:
        input_ids = fill_placeholders(self.input_ids[:size], self.previous_tokens)
        return ForwardBatch(input_ids, self.positions[:size],
                            self.slot_mapping[:size], self.block_tables[:size],
                            self.seq_lens[:size], self.query_start_loc[:size + 1],
                            self.logits_indices[:size], max_query_len=1,
                            state_slots=None if self.state_slots is None
                            else self.state_slots[:size])

    def _verify_batch(self, size: int) -> ForwardBatch:
        """The static inputs of a verify graph: `size` sequences of K + 1 tokens each."""
        k1 = self.max_draft + 1
        n = size * k1
        return ForwardBatch(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                            self.block_tables[:size], self.seq_lens[:size],
                            self.verify_starts[:size + 1], self.verify_rows[:n],
                            max_query_len=k1,
                            state_slots=None if self.state_slots is None
                            else self.state_slots[:size])

    def capture(self) -> DecodeGraphs:
        start = time.perf_counter()
        pool = None
        steps = [(size, False) for size in self.sizes] + [(s, True) for s in self.verify_sizes]
        # largest first: smaller graphs reuse its pool
        steps.sort(key=lambda step: step[0] * (self.max_draft + 1 if step[1] else 1),
                   reverse=True)
        with torch.inference_mode():
            for size, verifying in steps:
                make = self._verify_batch if verifying else self._static_batch
                if verifying:   # padding rows: K + 1 query tokens over page 0's first slots
                    self.seq_lens[:size].fill_(self.max_draft + 1)
                self.model.forward(make(size), self.kv)  # warm-up: kernels loaded
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.model.forward(make(size), self.kv)
                pool = graph.pool() if pool is None else pool
                graphs, outputs, hidden = ((self.verify_graphs, self.verify_outputs,
                                            self.verify_hidden) if verifying else
                                           (self.graphs, self.outputs, self.hidden))
                graphs[size], outputs[size] = graph, out
                hidden[size] = getattr(self.model, "last_hidden", None)
                self.seq_lens.fill_(1)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch %s) and %d verify graphs (K=%d, "
                 "batch %s) in %.2f s", len(self.graphs), ",".join(map(str, self.sizes)),
                 len(self.verify_graphs), self.max_draft,
                 ",".join(map(str, self.verify_sizes)) or "-", self.capture_seconds)
        return self

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.max_query_len == 1 and batch.num_tokens == batch.num_seqs
                and batch.num_seqs <= self.sizes[-1]
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch, previous_tokens: torch.Tensor | None = None
            ) -> torch.Tensor:
        """The logits of `batch`; placeholders in its input ids are filled from
        `previous_tokens` (the sampled ids of the step before, still on the device)."""
        size = self.load_inputs(batch, previous_tokens)
        self.graphs[size].replay()
        self._set_hidden(self.hidden[size], batch.num_seqs)
        return self.outputs[size][:batch.num_seqs]

    def _set_hidden(self, hidden: torch.Tensor | None, rows) -> None:
        """Leave the model's last_hidden as an eager forward would (the MTP block reads it)."""
        if hidden is not None:
            self.model.last_hidden = hidden[:rows] if isinstance(rows, int) else hidden[rows]

    def can_verify(self, draft_lengths: list[int], max_seq_len: int,
                   batch: ForwardBatch) -> bool:
        """Whether a step of decoding sequences with these draft counts (every chunk one last
        token and its drafts) replays a verify graph; `max_seq_len`: the longest sequence's
        length after the step."""
        k = self.max_draft
        if not self.verify_sizes or len(draft_lengths) > self.verify_sizes[-1] \
                or batch.multimodal is not None or max(draft_lengths) > k:
            return False
        if self.state_slots is not None and min(draft_lengths) != k:
            return False    # a hybrid model's states would move past padding
        # the padding rows' keys stay inside the graph's block tables
        return (batch.block_tables.shape[1] <= self.max_blocks
                and max_seq_len + k <= self.max_blocks * self.kv.block_size)

    def run_verify(self, draft_lengths: list[int], batch: ForwardBatch) -> torch.Tensor:
        """The logits of a verify step (can_verify), rows in the eager step's order."""
        b, k1 = batch.num_seqs, self.max_draft + 1
        size = next(s for s in self.verify_sizes if s >= b)
        dev = self.input_ids.device
        padded = any(n != k1 - 1 for n in draft_lengths) or size > b
        if not padded:
            rows = None
            n = b * k1
            self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
            self.positions[:n].copy_(batch.positions, non_blocking=True)
            self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
            self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        else:
            # each real token's row in the padded layout; padding repeats the sequence's last
            # position (a row of the rotary table that exists), stores nothing
            rows_host = [b_ * k1 + i for b_, n in enumerate(draft_lengths) for i in range(n + 1)]
            rows = torch.tensor(rows_host, dtype=torch.int64).to(dev, non_blocking=True)
            last = batch.query_start_loc[1:].long() - 1
            self.positions[:size * k1].view(size, k1)[:b] = \
                batch.positions[last].view(b, 1)
            self.positions[b * k1:size * k1].fill_(0)
            self.input_ids[:size * k1].zero_()
            self.slot_mapping[:size * k1].fill_(-1)
            self.input_ids[rows] = batch.input_ids
            self.positions[rows] = batch.positions
            self.slot_mapping[rows] = batch.slot_mapping
            pad = torch.tensor([k1 - 1 - n for n in draft_lengths], dtype=torch.int32
                               ).to(dev, non_blocking=True)
            self.seq_lens[:b] = batch.seq_lens + pad
            self.seq_lens[b:size].fill_(k1)
        width = batch.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(batch.block_tables, non_blocking=True)
        if size > b:
            self.block_tables[b:size].zero_()
        if self.state_slots is not None:
            self.state_slots[:b].copy_(batch.state_slots, non_blocking=True)
            self.state_slots[b:size].fill_(-1)
        self.verify_graphs[size].replay()
        self.verify_replays += 1
        out = self.verify_outputs[size]
        if rows is None:
            self._set_hidden(self.verify_hidden[size], b * k1)
            return out[:b * k1]
        self._set_hidden(self.verify_hidden[size], rows)
        return out[rows]

    def load_inputs(self, batch: ForwardBatch, previous_tokens: torch.Tensor | None = None
                    ) -> int:
        """Copy `batch` into the static inputs; returns the captured size that runs it."""
        b = batch.num_seqs
        size = next(s for s in self.sizes if s >= b)
        width = batch.block_tables.shape[1]
        self.input_ids[:b].copy_(batch.input_ids, non_blocking=True)
        if previous_tokens is not None:
            self.previous_tokens[:previous_tokens.shape[0]].copy_(previous_tokens,
                                                                  non_blocking=True)
        self.positions[:b].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:b].copy_(batch.slot_mapping, non_blocking=True)
        self.block_tables[:b, :width].copy_(batch.block_tables, non_blocking=True)
        self.seq_lens[:b].copy_(batch.seq_lens, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:b].copy_(batch.state_slots, non_blocking=True)
            self.state_slots[b:size].fill_(-1)
        if size > b:
            self.slot_mapping[b:size].fill_(-1)
            self.seq_lens[b:size].fill_(1)
            self.block_tables[b:size].zero_()
        return size
