"""The MLP blocks: a dense SwiGLU MLP, and a routed-expert (MoE) MLP with an optional shared
expert. Each takes the normed input x and returns the buffer holding its output.

MoE: router linear -> ops.moe_topk_softmax -> ops.moe_experts (GGUF blocks: the CPU's
ops.moe_experts_quant, the GPU's ops.moe_experts_gguf; FP8/NVFP4 experts on a GPU:
scaled_moe.ScaledExperts; FP8 experts on the CPU: scaled_moe.HostScaledExperts) over experts stacked once at load (w13 [E, 2I, H], w2 [E, H, I])
and an identity expert map; qwen2_moe adds shared_mlp(x) * sigmoid(x @ shared_gate). No loop
over experts: the kernels sort tokens by expert themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays, array_view, is_torch
from freetoken.models.batch import Array
from freetoken.models.checkpoint.weights import LayerWeights, Weight
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.forward.dequant import ExpertChunks
from freetoken.models.forward.linear import make_linear, packed_copy, packs_on_cpu
from freetoken.models.forward.workspace import WorkViews
from freetoken.models.quant.scaled import ScaledWeight

if TYPE_CHECKING:
    from freetoken.models.forward.decoder import Kernels


class DenseMLP:
    """down(act(gate(x)) * up(x)), written over x (or into `out`); act is SiLU, or GELU-tanh
    when `gelu` (gemma3)."""

    def __init__(self, gate_up: Weight, down: Weight, kernels: Kernels, gelu: bool = False):
        self.act_and_mul = kernels.gelu_tanh_and_mul if gelu else kernels.silu_and_mul
        self.gate_up = make_linear(gate_up)
        self.down = make_linear(down)

    def __call__(self, x: Array, w: WorkViews) -> Array:
        self.into(x, x, w.gate_up, w.act)
        return x

    def into(self, out: Array, x: Array, gate_up: Array, act: Array) -> None:
        self.gate_up(gate_up, x)
        self.act_and_mul(act, gate_up)
        self.down(out, act)


class MoEMLP:
    """Routed SwiGLU experts (+ a sigmoid-gated shared expert); writes w.other(x)."""

    def __init__(self, w: LayerWeights, cfg: ModelConfig, kernels: Kernels,
                 arrays: HostArrays | TorchArrays):
        arg, moe = kernels.arg, cfg.moe
        self.ops = kernels
        self.router = make_linear(w["router"], every_step=True)
        self.renormalize = moe.renormalize
        w13, w2 = w["experts.gate_up"], w["experts.down"]
        self.scaled = None
        if isinstance(w13, ScaledWeight) and isinstance(arrays, HostArrays):  # FP8, the CPU
            from freetoken.models.forward.scaled_moe import HostScaledExperts

            self.scaled = HostScaledExperts(w13, w2, moe.top_k)
            w13 = w2 = None
        elif isinstance(w13, ScaledWeight):     # FP8/NVFP4 experts on a GPU
            from freetoken.models.forward.scaled_moe import ScaledExperts, ScaledKernels

            # kernels of the model's device: offloaded FP8 experts sit in host memory until
            # the expert cache takes them (engine/expert_pool.ScaledPool)
            self.scaled = ScaledExperts(w13, w2, moe.top_k,
                                        ScaledKernels.for_device(arrays.device))
            w13 = w2 = None
        self.qtypes = (w13.qtype, w2.qtype) if isinstance(w13, QuantWeight) else ()
        # CPU: GGUF experts repacked 16 rows wide where linear.packs_on_cpu says so (every task
        # of the kernel starts on a whole tile: I rows of w13, H rows of w2)
        self.packed = (False, False)
        if self.qtypes:
            if arrays.device.is_cpu:
                self.packed = (packs_on_cpu(w13.qtype, w13.shape[-2] // 2, "moe_experts_quant"),
                               packs_on_cpu(w2.qtype, w2.shape[-2], "moe_experts_quant"))
            w13, w2 = (packed_copy(w.data, w.qtype) if pack else w.data
                       for w, pack in zip((w13, w2), self.packed))
        self.w13 = None if w13 is None else arg(w13)
        self.w2 = None if w2 is None else arg(w2)
        if any(self.packed):
            from freetoken.kernel import ops

            run, flags = ops.bind("moe_experts_quant_packed", "cpu"), self.packed
            self.experts_quant = (lambda out, x, w13, w2, q13, q2, *routing:
                                  run(out, x, w13, w2, q13, q2, *flags, *routing))
        elif self.qtypes:
            self.experts_quant = (kernels.moe_experts_quant if arrays.device.is_cpu
                                  else kernels.moe_experts_gguf)
        # GPU prefill steps: the experts dequantized a chunk at a time (dequant.py)
        self.prefill = None
        if self.qtypes and getattr(w13, "is_cuda", False):
            self.prefill = ExpertChunks(self.w13, self.w2, self.qtypes, w13.device)
        # every expert resident: slot e holds expert e (an offload cache remaps this later)
        self.expert_map = arg(arrays.index(np.arange(moe.num_experts, dtype=np.int32)))
        # Expert offload replaces the experts call: offload(out, x, topk_ids, topk_weights,
        # workspace) runs them through its slot pool (engine/expert_cache.py).
        self.offload = None
        # Small-step GPU decode (moe_decode.py), attached by the decoder where its rule allows.
        self.decode = None
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = DenseMLP(w["shared.gate_up"], w["shared.down"], kernels)
            self.shared_gate = make_linear(w["shared_gate"], every_step=True)

    def __call__(self, x: Array, w: WorkViews) -> Array:
        ops, out = self.ops, w.other(x)
        if self.decode_applies(x.shape[0]):
            self.decode(out, x, w, accumulate=False)
            return out
        self.router(w.router_logits, x)
        ops.moe_topk_softmax(w.topk_weights, w.topk_ids, w.router_logits, self.renormalize)
        if self.offload is not None:
            self.offload(out, x, w.topk_ids, w.topk_weights, w.moe_workspace)
        elif self.scaled is not None:
            self.scaled(out, x, w.topk_ids, w.topk_weights, self.expert_map, w.moe_workspace)
        elif self.prefill is not None and self.prefill.applies(x.shape[0]):
            self.prefill(out, x, w.topk_ids, w.topk_weights, self.expert_map, w.moe_workspace)
        elif self.qtypes:
            self.experts_quant(out, x, self.w13, self.w2, *self.qtypes, w.topk_ids,
                               w.topk_weights, self.expert_map, w.moe_workspace)
        else:
            ops.moe_experts(out, x, self.w13, self.w2, w.topk_ids, w.topk_weights,
                            self.expert_map, w.moe_workspace)
        if self.shared is not None:
            self.add_shared(out, x, w)
        return out

    def add_shared(self, out: Array, x: Array, w: WorkViews) -> None:
        """out += sigmoid(x @ shared_gate) * shared_mlp(x): the shared expert of qwen2_moe and
        the hybrid models, beside the routed ones."""
        self.shared.into(w.shared_out, x, w.shared_gate_up, w.shared_act)
        self.shared_gate(w.shared_gate, x)
        _add_gated(array_view(out), array_view(w.shared_out), array_view(w.shared_gate))

    def decode_applies(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens takes the small-step decode kernels (with an
        expert offload cache: only one that runs the routed experts in their blocks)."""
        return (self.decode is not None and tokens <= self.decode.max_tokens
                and (self.offload is None or getattr(self.offload, "fuses_decode", False)))


def _add_gated(out: Array, shared: Array, gate: Array) -> None:
    """out += sigmoid(gate) * shared, in place (gate [T, 1] broadcasts over the columns)."""
    if is_torch(out):
        out.addcmul_(gate.sigmoid_(), shared)
        return
    np.negative(gate, out=gate)
    np.exp(gate, out=gate)
    gate += 1.0
    np.reciprocal(gate, out=gate)
    shared *= gate
    out += shared
