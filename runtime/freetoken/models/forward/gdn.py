"""The Gated DeltaNet token mixer of the hybrid models (Qwen3-Next, Qwen3.5/3.6).

One input projection gives [q k v | z | b a]; q, k, v go through the short causal conv (SiLU)
and the gated delta-rule recurrence (ops.gdn_conv1d, ops.gdn_recurrence: both read and update
the sequence's recurrent-state slot); the result is RMS-normed per value head times silu(z)
(ops.rms_norm_gated) and projected back (out_proj), then the fused residual-add +
post-attention norm. Value heads are grouped by key head throughout; an out projection whose
columns take them tiled (LinearAttentionConfig.tiled_value_heads) gets its input reordered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken.models.batch import Array, ForwardBatch
from freetoken.models.checkpoint.weights import LayerWeights
from freetoken.models.config import ModelConfig
from freetoken.models.forward.linear import make_linear
from freetoken.models.forward.workspace import WorkViews

if TYPE_CHECKING:
    from freetoken.models.forward.decoder import Kernels


class GatedDeltaNetBlock:
    """Same call as AttentionBlock; its two caches are the layer's conv and delta-rule states."""

    def __init__(self, w: LayerWeights, cfg: ModelConfig, kernels: Kernels):
        arg = kernels.arg
        self.ops = kernels
        self.in_proj = make_linear(w["gdn.in"])
        self.out_proj = make_linear(w["gdn.out"])
        self.conv_w = arg(w["gdn.conv"])
        self.a_log, self.dt_bias = arg(w["gdn.A_log"]), arg(w["gdn.dt_bias"])
        self.norm = arg(w["gdn.norm"])
        self.post_norm = arg(w["post_norm"])
        self.eps = cfg.rms_norm_eps
        self.tiled = cfg.linear.tiled_value_heads

    def forward(self, x: Array, w: WorkViews, batch: ForwardBatch, conv_state: Array,
                ssm_state: Array, block_size: int) -> None:
        """x holds the layer's normed input; on return, the normed input of its MLP."""
        self.in_proj(w.gdn_in, x)
        self.mix(w, batch, conv_state, ssm_state)
        self.out_proj(x, w.gdn_core)
        self.ops.fused_add_rms_norm(x, w.residual, self.post_norm, self.eps)

    def mix(self, w: WorkViews, batch: ForwardBatch, conv_state: Array,
            ssm_state: Array) -> None:
        """w.gdn_in (the input projection) -> w.gdn_core (the out projection's input): the
        conv, the recurrence, the per-head norm gated by silu(z); updates both states."""
        ops = self.ops
        ops.gdn_conv1d(w.gdn_conv, w.gdn_qkv, conv_state, self.conv_w, batch.positions,
                       batch.query_start_loc, batch.state_slots)
        ops.gdn_recurrence(w.gdn_core, w.gdn_conv, w.gdn_ba, self.a_log, self.dt_bias, ssm_state,
                           batch.positions, batch.query_start_loc, batch.state_slots)
        if not self.tiled:
            ops.rms_norm_gated(w.gdn_core, w.gdn_core, w.gdn_z, self.norm, self.eps)
            return
        # the out projection takes the value heads tiled (llama.cpp's qwen35 files): norm
        # aside, then reorder into gdn_core
        ops.rms_norm_gated(w.gdn_grouped, w.gdn_core, w.gdn_z, self.norm, self.eps)
        w.tile_value_heads()
