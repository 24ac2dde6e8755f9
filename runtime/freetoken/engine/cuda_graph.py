"""Decode steps replayed from CUDA graphs captured once, at start, for fixed batch sizes.

A decode step of B sequences replays the graph of the smallest captured size >= B. Padding rows
store no KV (slot -1), attend to one slot of page 0 and their logits are dropped. Graphs hold raw
pointers: the model's work buffers must be reserved for the largest step before capture.

With overlap scheduling a step is launched before the previous one's tokens are read: its input
ids hold placeholders, and the graph itself fills them from a static copy of the previous step's
token array (engine/overlap.py) before the forward; real ids pass through unchanged.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken.engine.overlap import fill_placeholders
from freetoken.models.batch import ForwardBatch, KVCache

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    """Captured decode forwards; ``run`` copies a batch into the static inputs and replays."""

    def __init__(self, model, kv: KVCache, max_batch: int, max_blocks: int):
        self.model, self.kv = model, kv
        self.sizes = [s for s in BATCH_SIZES if s < max_batch] + [max_batch]
        self.max_blocks = max_blocks
        n, dev = self.sizes[-1], model.arrays.torch_device
        # Static inputs (device tensors); views of their first rows feed each graph.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
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
        self.capture_seconds = 0.0

    def _static_batch(self, size: int) -> ForwardBatch:
        input_ids = fill_placeholders(self.input_ids[:size], self.previous_tokens)
        return ForwardBatch(input_ids, self.positions[:size],
                            self.slot_mapping[:size], self.block_tables[:size],
                            self.seq_lens[:size], self.query_start_loc[:size + 1],
                            self.logits_indices[:size], max_query_len=1,
                            state_slots=None if self.state_slots is None
                            else self.state_slots[:size])

    def capture(self) -> DecodeGraphs:
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
                self.model.forward(self._static_batch(size), self.kv)  # warm-up: kernels loaded
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model.forward(self._static_batch(size), self.kv)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d decode CUDA graphs (batch %s) in %.2f s", len(self.graphs),
                 ",".join(map(str, self.sizes)), self.capture_seconds)
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
        return self.outputs[size][:batch.num_seqs]

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
