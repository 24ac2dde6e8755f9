"""Which slice of each weight a tensor-parallel rank holds, and the shape that rank computes.

Megatron-style: q/k/v and gate/up are split by output rows (heads, MLP columns), o and down by
input columns, so each rank's attention and MLP produce a partial sum that one all-reduce
completes. KV heads are replicated when there are fewer than ranks. The vocabulary is split
in contiguous chunks of ceil(V / N) rows (the last chunk padded with zero rows): the embedding
becomes a masked lookup + all-reduce, the LM head an all-gather of logits.

MoE: every expert's intermediate dimension is split (routing replicated, one all-reduce), not
whole experts per rank. With top-k routing a decode step touches k experts that may all live
on one rank under expert parallelism, so that rank does all the work while the others wait;
sliced experts split every token's work evenly at any batch size, need no token dispatch
(all-to-all), keep the experts kernel as it is and cost the same single all-reduce as a dense
MLP. Expert parallelism pays off only at large batches, where loads average out.

Slicing happens on the checkpoint's tensors before they are placed, and a rank keeps only its
slice: safetensors sources read the slice alone (``get_part``); a memory-mapped GGUF is read
only at a row split's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken.arrays import is_torch
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.errors import ModelOptionError, UnsupportedModelError
from freetoken.models.quant.scaled import ScaledWeight

ROWS, COLS = "rows", "cols"
# part -> (split axis, what it is split by); parts not named here are replicated (norms,
# the router, the shared-expert gate, per-head q/k norms).
RULES: dict[str, tuple[str, str]] = {
    "q": (ROWS, "q"), "q_bias": (ROWS, "q"), "k": (ROWS, "kv"), "k_bias": (ROWS, "kv"),
    "v": (ROWS, "kv"), "v_bias": (ROWS, "kv"), "o": (COLS, "q"),
    "gate": (ROWS, "mlp"), "up": (ROWS, "mlp"), "down": (COLS, "mlp"),
    "shared.gate": (ROWS, "shared"), "shared.up": (ROWS, "shared"),
    "shared.down": (COLS, "shared"),
    "experts.gate": (ROWS, "expert"), "experts.up": (ROWS, "expert"),
    "experts.down": (COLS, "expert"),
    "embed": (ROWS, "vocab"), "lm_head": (ROWS, "vocab"),
}


class ShardError(ModelOptionError):
    """The model cannot be split over this many ranks (named reason)."""


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size` tensor-parallel ranks."""

    rank: int
    size: int


def check_shardable(cfg: ModelConfig, size: int, source: str = "the model") -> None:
    """Raise ShardError naming the first dimension `size` ranks cannot split."""
    if size == 1:
        return
    if cfg.linear is not None:
        raise ShardError(f"{source}: hybrid (Gated DeltaNet) models are not supported with "
                         f"--tensor-parallel-size > 1 yet; serve it with -tp 1")
    if cfg.qk_norm == "full":
        raise ShardError(f"{source}: a q/k norm over whole projections ({cfg.architecture}) "
                         f"needs every head on one rank; serve it with -tp 1")
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % size:
        raise ShardError(f"{source}: --tensor-parallel-size {size} does not divide the "
                         f"{heads} attention heads")
    if kv % size and size % kv:
        raise ShardError(f"{source}: --tensor-parallel-size {size} neither divides the {kv} KV "
                         f"heads nor is a multiple of them")
    dense = cfg.moe is None or not all(cfg.moe.sparse_layers)
    if dense and cfg.intermediate_size % size:
        raise ShardError(f"{source}: --tensor-parallel-size {size} does not divide the MLP "
                         f"width {cfg.intermediate_size}")
    if cfg.moe is not None:
        for what, width in (("expert width", cfg.moe.intermediate_size),
                            ("shared-expert width", cfg.moe.shared_intermediate_size)):
            if width % size:
                raise ShardError(f"{source}: --tensor-parallel-size {size} does not divide "
                                 f"the {what} {width}")


def vocab_rows(vocab: int, size: int) -> int:
    """Rows of the embedding and LM head per rank (the last rank's tail is zero padding)."""
    return -(-vocab // size)


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The shape one of `size` ranks computes: its heads, MLP columns and vocabulary rows."""
    if size == 1:
        return cfg
    moe = cfg.moe
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // size,
                                  shared_intermediate_size=moe.shared_intermediate_size // size)
    inter = cfg.intermediate_size
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(cfg.num_kv_heads // size, 1),
        intermediate_size=inter // size if inter % size == 0 else inter,
        vocab_size=vocab_rows(cfg.vocab_size, size), moe=moe)


def _span(cfg: ModelConfig, shard: Shard, by: str) -> tuple[int, int]:
    """[start, end) of this rank's slice along the split axis, in elements."""
    r, n = shard.rank, shard.size
    if by == "kv":
        kv, d = cfg.num_kv_heads, cfg.head_dim
        head = r * kv // n if kv >= n else r // (n // kv)
        count = max(kv // n, 1)
        return head * d, (head + count) * d
    width = {"q": cfg.q_size, "mlp": cfg.intermediate_size,
             "shared": cfg.moe.shared_intermediate_size if cfg.moe else 0,
             "expert": cfg.moe.intermediate_size if cfg.moe else 0,
             "vocab": vocab_rows(cfg.vocab_size, n) * n}[by]
    step = width // n
    return r * step, (r + 1) * step


def _dim(axis: str, ndim: int) -> int:
    """The dimension a rule splits: the last for columns (and vectors), else the rows."""
    return ndim - 1 if axis == COLS or ndim == 1 else ndim - 2


def _part(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("layers.") else name


class ShardedSource:
    """A TensorSource that hands out this rank's slice of every split weight."""

    def __init__(self, src: Any, cfg: ModelConfig, shard: Shard):
        self.src, self.cfg, self.shard = src, cfg, shard
        self.source = src.source
        # what this rank placed: float elements (their bytes depend on the placed dtype) and
        # GGUF block bytes, for the per-rank memory in /v1/stats
        self.float_elements = self.block_bytes = 0

    def placed_bytes(self, dtype: str) -> int:
        return self.float_elements * (4 if dtype == "float32" else 2) + self.block_bytes

    def file_name(self, name: str) -> str:
        return self.src.file_name(name)

    def get(self, name: str):
        weight = self._get(name)
        if isinstance(weight, QuantWeight):
            self.block_bytes += int(weight.data.nbytes)
        elif weight is not None and not isinstance(weight, ScaledWeight):
            self.float_elements += int(np.prod(weight.shape))
        return weight

    def _get(self, name: str):
        rule = RULES.get(_part(name))
        if rule is not None and self.shard.size > 1 and hasattr(self.src, "get_part"):
            axis, by = rule     # safetensors: read the slice alone
            ndim = 3 if ".experts." in name else 1 if name.endswith("_bias") else 2
            part = self.src.get_part(name, _dim(axis, ndim), *_span(self.cfg, self.shard, by))
            if part is not None:
                return part.contiguous()
        weight = self.src.get(name)
        if weight is None or rule is None or self.shard.size == 1:
            return weight
        axis, by = rule
        start, end = _span(self.cfg, self.shard, by)
        dim = _dim(axis, len(weight.shape))
        if isinstance(weight, ScaledWeight):
            raise UnsupportedModelError(
                f"{self.source}: tensor {self.file_name(name)!r} is {weight.format}-scaled, "
                f"which tensor parallelism does not split yet; serve it with -tp 1")
        if isinstance(weight, QuantWeight):
            return self._quant_slice(name, weight, dim, start, end)
        return slice_along(weight, dim, start, end)

    def _quant_slice(self, name: str, weight: QuantWeight, dim: int, start: int,
                     end: int) -> QuantWeight:
        """GGUF blocks: a row split takes whole rows; a column split whole blocks of a row."""
        shape = list(weight.shape)
        if dim == len(shape) - 2:
            shape[dim] = end - start
            return QuantWeight(weight.qtype, slice_along(weight.data, dim, start, end),
                               tuple(shape))
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(weight.qtype)]
        if start % block or end % block:
            raise UnsupportedModelError(
                f"{self.source}: tensor {self.file_name(name)!r} has "
                f"{GGMLQuantizationType(weight.qtype).name} blocks of {block} columns, which "
                f"do not split at column {start}; use fewer ranks or a float checkpoint")
        shape[dim] = end - start
        data = slice_along(weight.data, dim, start // block * size, end // block * size)
        return QuantWeight(weight.qtype, data, tuple(shape))


def slice_along(weight, dim: int, start: int, end: int):
    """weight[..., start:end, ...] along `dim` as a contiguous copy; rows past the end are
    zero padding (the vocabulary's last chunk)."""
    have = weight.shape[dim]
    index = [slice(None)] * len(weight.shape)
    index[dim] = slice(start, min(end, have))
    part = weight[tuple(index)]
    missing = end - max(start, have) if end > have else 0
    if is_torch(part):
        import torch

        if missing:
            pad = list(part.shape)
            pad[dim] = missing
            part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], dim=dim)
        return part.contiguous()
    part = np.asarray(part)
    if missing:
        pad = list(part.shape)
        pad[dim] = missing
        part = np.concatenate([part, np.zeros(pad, dtype=part.dtype)], axis=dim)
    return np.ascontiguousarray(part)
