"""The MTP block's step after a decode or verify step (engine/mtp_drafts.py), replayed from
CUDA graphs: the block over each sequence's newly known positions, then its K - 1 recursive
draft steps, argmax included, in one replay with one read of the K drafts at the end. Eagerly
the same step costs K forwards' launches and K host synchronisations, more than a plain decode
step of a one-layer block should.

One graph per batch size S up to VERIFY_MAX_BATCH (engine/speculative.py), for the configured
K. The catch-up forward takes S x (K + 1) rows: sequence b owns rows b(K+1) .. b(K+1)+K, which
hold its positions end-K-1 .. end-1 (end: the tokens it has computed). Its new positions are the
last rows; the rows before them are padding at positions the block's pool already holds (slot
-1: nothing is written), so every key a real row reads is a real key, as eagerly. Draft step d
(1 <= d < K) takes one row per sequence at position end+d-1, its input the last draft; a
sequence that does not draft that deep sits at position end-1 with slot -1 and its drafts are
dropped. Graphs hold raw pointers: the block's work buffers are reserved for the largest step
(a prompt chunk included) before capture, and a resized pool captures again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from freetoken.engine.cuda_graph import BATCH_SIZES
from freetoken.engine.prepare import page_rows
from freetoken.engine.speculative import VERIFY_MAX_BATCH
from freetoken.models.batch import ForwardBatch, KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphStepInputs:
    """Host arrays of one replay over `size` sequences (the first len(parts) real).

    input_ids, positions, slots: [size * (K + 1)] int64, the catch-up rows; seq_lens [size]
    int32; draft_positions, draft_slots [K - 1, size] int64 and draft_seq_lens [K - 1, size]
    int32: the draft steps."""

    size: int
    input_ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    seq_lens: np.ndarray
    draft_positions: np.ndarray
    draft_slots: np.ndarray
    draft_seq_lens: np.ndarray


def fits_graph(parts: list, num_draft: int, max_size: int, max_blocks: int,
               block_size: int) -> bool:
    """Whether the block's step over `parts` (mtp_drafts.BlockRows) replays a graph: at most
    `max_size` sequences, each with 1..K+1 new positions and at least K+1 in all (the padding
    sits on earlier ones), whose pages for end + K tokens fit the graph's block tables."""
    rows = num_draft + 1
    return 0 < len(parts) <= max_size and all(
        part.count <= rows and part.start + part.count >= rows
        and -(-(part.start + part.count + num_draft) // block_size) <= max_blocks
        for part in parts)


def graph_step_inputs(parts: list, depths: list[int], num_draft: int, size: int,
                      slot) -> GraphStepInputs:
    """The replay's host inputs for `parts` (fits_graph), each drafting `depths[i]` tokens (0:
    it does not draft); slot(request, position) is the pool slot of a position."""
    rows, steps = num_draft + 1, num_draft - 1
    input_ids = np.zeros(size * rows, dtype=np.int64)
    positions = np.tile(np.arange(rows, dtype=np.int64), size)     # padding sequences
    slots = np.full(size * rows, -1, dtype=np.int64)
    seq_lens = np.full(size, rows, dtype=np.int32)
    draft_positions = np.zeros((steps, size), dtype=np.int64)
    draft_slots = np.full((steps, size), -1, dtype=np.int64)
    draft_seq_lens = np.ones((steps, size), dtype=np.int32)
    for b, (part, depth) in enumerate(zip(parts, depths)):
        request, end = part.request, part.start + part.count
        first = b * rows
        span = range(end - rows, end)
        positions[first:first + rows] = span
        input_ids[first:first + rows] = request.token_ids[end - rows + 1:end + 1]
        new = first + rows - part.count       # the part's own rows: the last `count`
        slots[new:first + rows] = [slot(request, p) for p in range(part.start, end)]
        seq_lens[b] = end
        for d in range(1, num_draft):
            if d < depth:   # this sequence drafts its (d+1)-th token at position end + d - 1
                draft_positions[d - 1, b] = end + d - 1
                draft_slots[d - 1, b] = slot(request, end + d - 1)
                draft_seq_lens[d - 1, b] = end + d
            else:           # a row whose output is dropped, over keys that exist
                draft_positions[d - 1, b] = end - 1
                draft_seq_lens[d - 1, b] = end
    return GraphStepInputs(size, input_ids, positions, slots, seq_lens, draft_positions,
                           draft_slots, draft_seq_lens)


def new_rows(parts: list, num_draft: int) -> list[int]:
    """The padded layout's rows of the parts' new positions, in the eager step's order: the
    last part.count of each sequence's K + 1."""
    rows = num_draft + 1
    return [r for b, part in enumerate(parts)
            for r in range((b + 1) * rows - part.count, (b + 1) * rows)]


class MTPGraphs:
    """Captured block steps; ``load_hidden`` then ``run`` replay one."""

    def __init__(self, block: Any, kv: KVCache, num_draft: int, max_batch: int,
                 max_blocks: int):
        self.block, self.kv, self.num_draft = block, kv, num_draft
        largest = min(max_batch, VERIFY_MAX_BATCH)
        self.sizes = [s for s in BATCH_SIZES if s < largest] + [largest]
        self.max_blocks, self.block_size = max_blocks, kv.block_size
        rows, n, dev = num_draft + 1, self.sizes[-1], block.arrays.torch_device
        t = n * rows
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=dev)
        self.hidden = torch.zeros((t, block.config.hidden_size),
                                  dtype=block.arrays.dtype(block.dtype), device=dev)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.full((n,), rows, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(0, t + 1, rows, dtype=torch.int32, device=dev)
        self.last_rows = torch.arange(rows - 1, t, rows, dtype=torch.int64, device=dev)
        steps = max(num_draft - 1, 0)
        self.draft_positions = torch.zeros((steps, n), dtype=torch.int64, device=dev)
        self.draft_slots = torch.full((steps, n), -1, dtype=torch.int64, device=dev)
        self.draft_seq_lens = torch.ones((steps, n), dtype=torch.int32, device=dev)
        self.one_each = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.each_row = torch.arange(n, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros((n, num_draft), dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.capture_seconds = 0.0

    def _forwards(self, size: int) -> None:
        """The block's step over the static inputs of `size` sequences: drafts[:size]."""
        rows = self.num_draft + 1
        n = size * rows
        batch = ForwardBatch(self.input_ids[:n], self.positions[:n], self.slot_mapping[:n],
                             self.block_tables[:size], self.seq_lens[:size],
                             self.query_start_loc[:size + 1], self.last_rows[:size],
                             max_query_len=rows)
        logits, hidden = self.block.forward(batch, self.hidden[:n], self.kv)
        tokens = logits.argmax(-1)
        self.drafts[:size, 0].copy_(tokens)
        for d in range(1, self.num_draft):
            step = ForwardBatch(tokens, self.draft_positions[d - 1, :size],
                                self.draft_slots[d - 1, :size], self.block_tables[:size],
                                self.draft_seq_lens[d - 1, :size], self.one_each[:size + 1],
                                self.each_row[:size], max_query_len=1)
            logits, hidden = self.block.forward(step, hidden, self.kv, step=d)
            tokens = logits.argmax(-1)
            self.drafts[:size, d].copy_(tokens)

    def capture(self) -> MTPGraphs:
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):   # largest first: the others reuse its pool
                self._forwards(size)             # warm-up: kernels loaded
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._forwards(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d MTP draft CUDA graphs (K=%d, batch %s) in %.2f s",
                 len(self.graphs), self.num_draft, ",".join(map(str, self.sizes)),
                 self.capture_seconds)
        return self

    def takes(self, parts: list) -> bool:
        return fits_graph(parts, self.num_draft, self.sizes[-1], self.max_blocks,
                          self.block_size)

    def load_hidden(self, parts: list, last_hidden: torch.Tensor) -> None:
        """Copy the target's hidden rows of `parts` (takes) into their padded rows, before
        anything runs the target again."""
        dev = self.hidden.device
        src = [r for part in parts for r in part.rows]
        dst = torch.tensor(new_rows(parts, self.num_draft), dtype=torch.int64)
        self.hidden[dst.to(dev, non_blocking=True)] = \
            last_hidden[torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)]

    def hidden_rows(self, parts: list) -> torch.Tensor:
        """The loaded hidden rows of `parts` in the eager step's order (mtp_drafts' fallback)."""
        dst = torch.tensor(new_rows(parts, self.num_draft), dtype=torch.int64)
        return self.hidden[dst.to(self.hidden.device)]

    def run(self, parts: list, depths: list[int], slot) -> list[list[int]]:
        """Replay the step over `parts` (load_hidden first; every part's pages extended for
        its depth); each part's drafts (depths[i] of them)."""
        size = next(s for s in self.sizes if s >= len(parts))
        host = graph_step_inputs(parts, depths, self.num_draft, size, slot)
        n, steps = size * (self.num_draft + 1), self.num_draft - 1
        self.input_ids[:n].copy_(torch.from_numpy(host.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(host.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(host.slots), non_blocking=True)
        self.seq_lens[:size].copy_(torch.from_numpy(host.seq_lens), non_blocking=True)
        if steps:
            self.draft_positions[:, :size].copy_(torch.from_numpy(host.draft_positions),
                                                 non_blocking=True)
            self.draft_slots[:, :size].copy_(torch.from_numpy(host.draft_slots),
                                             non_blocking=True)
            self.draft_seq_lens[:, :size].copy_(torch.from_numpy(host.draft_seq_lens),
                                                non_blocking=True)
        width = max(len(part.request.pages) for part in parts)
        tables = np.zeros((size, width), dtype=np.int32)
        for b, part in enumerate(parts):
            tables[b, :len(part.request.pages)] = page_rows(part.request)
        self.block_tables[:size, :width].copy_(torch.from_numpy(tables), non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1
        drafts = self.drafts[:len(parts)].tolist()
        return [row[:depth] for row, depth in zip(drafts, depths)]
