"""One rank's model: the decoder built over its weight slices, plus the collectives that make
its partial results whole (one all-reduce after attention, one after the MLP, one after the
masked embedding lookup, and an all-gather of the vocabulary-split logits)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from freetoken.arrays import array_view, is_torch
from freetoken.parallel.group import Comm
from freetoken.parallel.shard import vocab_rows


class ReducedLinear:
    """A row-split projection (o, down): each rank's product is a partial sum."""

    def __init__(self, linear: Any, comm: Comm):
        self.linear, self.comm = linear, comm

    def __call__(self, out, x) -> None:
        self.linear(out, x)
        self.comm.all_reduce(out)


class ReducedMLP:
    """A dense or MoE MLP whose down projections are row-split: the block's output (routed
    experts and shared expert together) is summed over ranks once."""

    def __init__(self, mlp: Any, comm: Comm):
        self.mlp, self.comm = mlp, comm

    def __call__(self, x, w):
        out = self.mlp(x, w)
        self.comm.all_reduce(out)
        return out


class VocabEmbedding:
    """Lookup of the rows this rank holds; other ids read row 0 and are zeroed, so the sum
    over ranks is the full embedding."""

    def __init__(self, lookup: Any, start: int, rows: int, comm: Comm, arrays: Any):
        self.lookup, self.start, self.rows = lookup, start, rows
        self.comm, self.arrays = comm, arrays

    def __call__(self, out, ids) -> None:
        local = array_view(ids) - self.start
        outside = (local < 0) | (local >= self.rows)
        view = array_view(out)
        if is_torch(local):
            local.masked_fill_(outside, 0)
            self.lookup(out, local)
            view.masked_fill_(outside[:, None], 0)
        else:
            local[outside] = 0
            self.lookup(out, self.arrays.kernel_arg(np.ascontiguousarray(local)))
            view[outside] = 0
        self.comm.all_reduce(out)


class RankModel:
    """A rank's decoder with its collectives; ``forward`` returns the full-vocabulary logits
    on every rank. ``config`` is the rank's shape (its heads size its KV pool) with the full
    vocabulary."""

    def __init__(self, decoder: Any, comm: Comm, vocab_size: int):
        self.decoder, self.comm = decoder, comm
        self.vocab_size = vocab_size
        # NOTE: the fused GPU decode layers run o and down inside their own kernels, where no
        # all-reduce can follow: a sharded model takes the unfused chain.
        decoder.use_fused_layers(None)
        for layer in decoder.layers:
            layer.attn.o = ReducedLinear(layer.attn.o, comm)
            layer.mlp = ReducedMLP(layer.mlp, comm)
        rows = vocab_rows(vocab_size, comm.size)
        decoder._embed_into = VocabEmbedding(decoder._embed_into, comm.rank * rows, rows,
                                             comm, decoder.arrays)
        self.config = dataclasses.replace(decoder.config, vocab_size=vocab_size)
        self.arrays, self.dtype, self.device = decoder.arrays, decoder.dtype, decoder.device

    def reserve(self, max_tokens: int) -> None:
        self.decoder.reserve(max_tokens)

    def forward(self, batch, kv):
        local = self.decoder.forward(batch, kv)
        return self.comm.all_gather_cols(local, self.vocab_size)

