"""Drafting with the model's own multi-token-prediction block (models/forward/mtp.py).

The block predicts the token after next from the target's hidden state h_t and the next token
x_{t+1}, attending over its own K/V of earlier positions (a pool beside the target's: same
pages, same slot for a position). It lags the target by one token. After every step each
sequence of the step runs through the block over the positions whose next token is known now
(a prefill chunk's, a decode's one, a verify step's accepted ones), so the block's pool stays
filled; a sequence ready to decode then takes the argmax of its last row as its first draft
token, and K-1 more steps of the block over its own output give the rest. Drafts are argmax
tokens: verification keeps sampled requests' distribution all the same (engine/speculative.py).

On a GPU the target's steps replay their CUDA graphs (engine/cuda_graph.py leaves the model's
last_hidden as an eager forward would), and so do the block's own steps after a decode or
verify step (engine/mtp_graphs.py: the catch-up and every draft step in one replay); its steps
after a prompt chunk run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken.arrays import array_view
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.prepare import pack_batch
from freetoken.engine.request import Request
from freetoken.models.batch import ForwardBatch

logger = logging.getLogger("freetoken.engine")


@dataclass
class BlockRows:
    """One sequence's part of a block step: positions start..start+count-1, whose hidden
    states are rows `rows` of the target's step and whose next tokens are in token_ids."""

    request: Request
    start: int
    count: int
    rows: range


class MTPDrafts:
    """The block's K/V pool and its step after each target step."""

    def __init__(self, model: Any, num_blocks: int, block_size: int, kv_dtype: str,
                 num_tokens: int):
        self.model, self.block = model, model.mtp
        self.kv = self.block.create_kv_cache(num_blocks, block_size, kv_dtype)
        self.block_size, self.arrays = block_size, model.arrays
        self.num_tokens = num_tokens
        self.graphs = None   # engine/mtp_graphs.py, on a GPU with CUDA graphs

    def resize(self, num_blocks: int, kv_dtype: str) -> None:
        """A new pool for a resized target pool (its contents are gone, as the target's; its
        graphs are gone until capture_graphs runs again)."""
        self.kv = self.block.create_kv_cache(num_blocks, self.block_size, kv_dtype)
        self.graphs = None

    def capture_graphs(self, max_batch: int, max_blocks: int, max_tokens: int) -> None:
        """CUDA graphs of the block's step after decode and verify steps of up to `max_batch`
        sequences; `max_tokens`: the most tokens any step of the block takes (its work
        buffers are reserved for them first, so the graphs' pointers stay valid)."""
        from freetoken.engine.mtp_graphs import MTPGraphs

        self.block.reserve(max_tokens)
        try:
            self.graphs = MTPGraphs(self.block, self.kv, self.num_tokens, max_batch,
                                    max_blocks).capture()
        except RuntimeError as exc:     # torch reports capture failures as RuntimeError
            logger.warning("the MTP block's steps run eagerly: capturing their CUDA graphs "
                           "failed (%s)", exc)
            self.graphs = None

    def take_hidden(self, parts: list[BlockRows]) -> Any:
        """What `step` reads of the target's hidden states for `parts`, taken now (before
        anything runs the target again): loaded into the graphs' inputs where a graph takes
        the step (IN_GRAPHS), else a copy of the rows (hidden_rows)."""
        if self.graphs is not None and self.graphs.takes(parts):
            self.graphs.load_hidden(parts, array_view(self.model.last_hidden))
            return IN_GRAPHS
        return self.hidden_rows(parts)

    def hidden_rows(self, parts: list[BlockRows]) -> Any:
        """A copy of the target's hidden states for `parts` (taken before anything else runs
        the target again: a hybrid model's replay would overwrite them)."""
        index = np.fromiter((r for part in parts for r in part.rows), dtype=np.int64)
        return array_view(self.model.last_hidden)[self.arrays.index(index)]

    def step(self, parts: list[BlockRows], hidden: Any, pool: PagePool,
             drafting: list[Request]) -> None:
        """Run the block over `parts`, then draft for the requests in `drafting` (each one of
        the parts, ready to decode): their `draft_state.mtp_draft` is set. `hidden`: what
        take_hidden returned for `parts`."""
        if hidden is IN_GRAPHS:
            hidden = self._graph_step(parts, pool, drafting)
            if hidden is None:
                return
        depths = draft_depths(parts, {id(r) for r in drafting}, self.num_tokens, pool)
        logits, out = self.block.forward(self._batch(parts), hidden, self.kv)
        rows = [i for i, depth in enumerate(depths) if depth]
        if not rows:
            return
        drafts = {i: [t] for i, t in zip(rows, _argmax(logits[self._index(rows)]))}
        hidden_rows = array_view(out)[self._index(rows)]
        for depth in range(1, self.num_tokens):
            # position N + depth - 1 (N: the tokens the target has computed) takes the last
            # draft, where draft_depths found its page
            going = [i for i in rows if depths[i] > depth]
            if not going:
                break
            keep = [rows.index(i) for i in going]
            batch = self._draft_batch([parts[i].request for i in going],
                                      [drafts[i][-1] for i in going], depth)
            hidden_in = hidden_rows[self.arrays.index(np.asarray(keep, dtype=np.int64))]
            logits, out = self.block.forward(batch, hidden_in, self.kv, step=depth)
            for i, token in zip(going, _argmax(logits)):
                drafts[i].append(token)
            rows, hidden_rows = going, array_view(out)
        for i, tokens in drafts.items():
            parts[i].request.draft_state.mtp_draft = tuple(tokens)

    def _graph_step(self, parts: list[BlockRows], pool: PagePool,
                    drafting: list[Request]) -> Any:
        """The step replayed from a graph; None when done, else (a request's pages grew past
        the graphs' block tables) the hidden rows for the eager step."""
        depths = draft_depths(parts, {id(r) for r in drafting}, self.num_tokens, pool)
        if any(len(part.request.pages) > self.graphs.max_blocks for part in parts):
            return self.graphs.hidden_rows(parts)
        for part, tokens in zip(parts, self.graphs.run(parts, depths, self._slot)):
            if tokens:
                part.request.draft_state.mtp_draft = tuple(tokens)
        return None

    def _index(self, rows: list[int]):
        return self.arrays.index(np.asarray(rows, dtype=np.int64))

    def _batch(self, parts: list[BlockRows]) -> ForwardBatch:
        """The block's step: each part's positions, its next tokens, the target's slots."""
        ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for part in parts:
            request, end = part.request, part.start + part.count
            ids += request.token_ids[part.start + 1:end + 1]
            positions += range(part.start, end)
            slots += [self._slot(request, p) for p in range(part.start, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + part.count)
        return pack_batch([p.request for p in parts], ids, positions, slots, seq_lens, starts,
                          [s - 1 for s in starts[1:]], self.arrays)

    def _draft_batch(self, requests: list[Request], tokens: list[int],
                     depth: int) -> ForwardBatch:
        """One token per drafting request at position N + depth - 1, holding its last draft."""
        positions = [r.num_computed + depth - 1 for r in requests]
        slots = [self._slot(r, p) for r, p in zip(requests, positions)]
        return pack_batch(requests, tokens, positions, slots, [p + 1 for p in positions],
                          list(range(len(requests) + 1)), list(range(len(requests))), self.arrays)

    def _slot(self, request: Request, position: int) -> int:
        page = request.pages[position // self.block_size]
        return page * self.block_size + position % self.block_size


def draft_depths(parts: list, drafting: set[int], num_draft: int, pool: PagePool) -> list[int]:
    """How many tokens each part drafts (0 where its request is not in `drafting`, by id),
    for the eager step and the graphs alike: pages grow depth by depth (draft step d writes
    position end + d - 1), a sequence stopping where the pool has no page for it."""
    depths = [1 if id(part.request) in drafting else 0 for part in parts]
    going = [i for i, depth in enumerate(depths) if depth]
    for depth in range(1, num_draft):
        going = [i for i in going
                 if pool.extend(parts[i].request.pages, parts[i].start + parts[i].count + depth)]
        for i in going:
            depths[i] += 1
    return depths


IN_GRAPHS = object()   # take_hidden: the hidden rows wait in the graphs' inputs


def _argmax(logits) -> list[int]:
    return [int(t) for t in logits.argmax(-1).tolist()]
