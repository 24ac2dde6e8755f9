"""The attention block of every decoder layer: qkv projection (+ bias), optional q/k RMSNorm
(per head, or over the whole projections), rope, KV store, paged attention (with the layer's
sliding window), o projection, gemma3's norm of the block output, and the fused residual-add +
post-attention norm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from freetoken.arrays import array_view, is_torch
from freetoken.models.batch import Array, ForwardBatch
from freetoken.models.checkpoint.weights import LayerWeights
from freetoken.models.config import ModelConfig
from freetoken.models.forward.linear import make_linear
from freetoken.models.forward.workspace import WorkViews

if TYPE_CHECKING:
    from freetoken.models.forward.decoder import Kernels


class AttentionBlock:
    def __init__(self, w: LayerWeights, cfg: ModelConfig, rope: Array, kernels: Kernels,
                 index: int = 0):
        self.ops = kernels
        arg = kernels.arg
        self.post_norm = arg(w["post_norm"])
        self.out_norm = arg(w["attn_out_norm"]) if "attn_out_norm" in w else None
        self.qk_norm = cfg.qk_norm
        self.q_norm = arg(w["q_norm"]) if cfg.qk_norm else None
        self.k_norm = arg(w["k_norm"]) if cfg.qk_norm else None
        self.qkv = make_linear(w["qkv"], w.get("qkv_bias"))
        self.o = make_linear(w["o"])
        self.rope = rope
        self.eps = cfg.rms_norm_eps
        self.head_dim, self.is_neox = cfg.head_dim, cfg.rope_is_neox
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5
        self.window = cfg.window(index)
        # hybrid models: the attention output times sigmoid(x @ o_gate) before o
        self.gate = make_linear(w["o_gate"]) if "o_gate" in w else None

    def _norm_qk(self, w: WorkViews) -> None:
        """In place: each row is read before it is written."""
        rms_norm = self.ops.rms_norm
        if self.qk_norm == "head":
            rms_norm(w.q_heads, w.q_heads, self.q_norm, self.eps)
            rms_norm(w.k_heads, w.k_heads, self.k_norm, self.eps)
        elif self.qk_norm == "full":
            rms_norm(w.q, w.q, self.q_norm, self.eps)
            rms_norm(w.k, w.k, self.k_norm, self.eps)

    def forward(self, x: Array, w: WorkViews, batch: ForwardBatch, k_cache: Array,
                v_cache: Array, block_size: int) -> None:
        """x holds the layer's normed input; on return, the normed input of its MLP."""
        ops = self.ops
        self.qkv(w.qkv, x)
        if self.gate is not None:
            self.gate(w.attn_gate, x)
        w.split_qkv()
        self._norm_qk(w)
        ops.rotary_embedding(batch.positions, w.q, w.k, self.rope, self.head_dim, self.is_neox)
        ops.store_kv(w.k3, w.v3, k_cache, v_cache, batch.slot_mapping)
        ops.paged_attention(w.attn3, w.q3, k_cache, v_cache, batch.block_tables,
                            batch.seq_lens, batch.query_start_loc, block_size, self.scale,
                            self.window, *ops.attn_extra)
        if self.gate is not None:
            mul_sigmoid(array_view(w.attn), array_view(w.attn_gate))
        self.o(x, w.attn)
        if self.out_norm is not None:
            ops.rms_norm(x, x, self.out_norm, self.eps)
        ops.fused_add_rms_norm(x, w.residual, self.post_norm, self.eps)


def mul_sigmoid(out: Array, gate: Array) -> None:
    """out *= sigmoid(gate), in place; gate is overwritten on the CPU."""
    if is_torch(out):
        out.mul_(gate.sigmoid())
        return
    np.negative(gate, out=gate)
    np.exp(gate, out=gate)
    gate += 1.0
    out /= gate
