"""The GPU MoE decode step over GGUF experts kept in their blocks (T <= MAX_TOKENS, the decode
batches): four launches per MoE layer after its normed input, as moe_decode.py's for float
experts:

    decode_gemv       router logits (the layer's own linear where decode_gemv cannot read it)
    moe_topk_softmax  softmax, top-k, norm_topk_prob renormalisation
    moe_q8_gate_up    SwiGLU of every routed pair's expert on int8 activations (dp4a)
    moe_q8_down       the token's routed experts' down rows as one dot product over its K * I
                      activations, each segment's scales times its routing weight; written as
                      the MLP output or added to the residual stream

(kernels/include/freetoken/gguf_gemv_q8_kernels.cuh). A shared expert (qwen2_moe, Qwen3.5/3.6)
runs after them through its own projections and sigmoid gate. The rule (decided once at load,
per layer): a CUDA/ROCm device, bf16 activations, GGUF experts of types the kernels read, H and
K * I within their staging, Q4_K down rows of whole 256-weight blocks, top_k <= 16. Per step:
T <= MAX_TOKENS; wider steps keep moe_experts_gguf. Ids stay on the device: no host sync,
graph-capturable. With an expert offload cache that keeps the blocks (engine/expert_pool.py's
BlockPool), the routed experts go through the cache, which launches the same two kernels over
its slots: the router, top-k and shared expert stay here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken.kernel import ops
from freetoken.models.batch import Array
from freetoken.models.forward import quant_gemv
from freetoken.models.forward.moe_decode import ROUTER_GEMV_VARIANT, one_matrix, router_group
from freetoken.models.forward.workspace import WorkViews

if TYPE_CHECKING:
    from freetoken.models.checkpoint.weights import LayerWeights
    from freetoken.models.config import ModelConfig
    from freetoken.models.forward.mlp import MoEMLP

# Each routed pair streams its expert once (a block row per pair), so the kernels take any
# step; past a few dozen tokens the pairs re-read shared experts often enough that the grouped
# GEMM over dequantized experts wins (dequant.ExpertChunks).
MAX_TOKENS = 32
MAX_TOP_K = 16          # kernels: gemv_q8::kMaxTopK
Q4_K = 12
# launched as programmatic dependents (sm_90+): gate/up's blocks are scheduled while the
# routing drains, down's stream their first weights while gate/up drains
PDL = True
GEMV_MAX_TOKENS = 8     # decode_gemv's rows (the router; wider steps take the layer's linear)
# Q4_K weight rows per warp of each half (1 or 2); 1 is what the H100 measured
# (benchmarks/results/h100-gpu_vs_llamacpp-q4km-30b-8b.log); benchmarks/moe_q8_sweep.py times
# both against the bandwidth
GATE_UP_ROWS = 1
DOWN_ROWS = 1


def step_act(workspace, pairs: int, inter: int):
    """gate/up's output, down's input: act bf16 [pairs, I] at the start of the MoE workspace
    (uint8)."""
    import torch

    return workspace[:2 * pairs * inter].view(torch.bfloat16).view(pairs, inter)


def eligible(cfg: ModelConfig, mlp: MoEMLP, dtype: str, device) -> bool:
    """The load-time rule of the module doc, for one MoE layer."""
    from freetoken import env

    settings = env.read()
    if (device.is_cpu or dtype != "bfloat16" or not settings.fused_decode
            or not settings.moe_decode or not mlp.qtypes or mlp.w13 is None):
        return False
    q13, q2 = mlp.qtypes
    h, inter, k = cfg.hidden_size, cfg.moe.intermediate_size, cfg.moe.top_k
    if q13 not in quant_gemv.Q8_BLOCKS or q2 not in quant_gemv.Q8_BLOCKS or k > MAX_TOP_K:
        return False
    if h % quant_gemv.Q8_BLOCKS[q13][0] or inter % quant_gemv.Q8_BLOCKS[q2][0]:
        return False
    if q2 == Q4_K and inter % 256:
        return False
    return h <= quant_gemv.q8_capacity(q13) and k * inter <= quant_gemv.q8_capacity(q2)


class QuantMoEDecode:
    """One MoE layer's small-step decode over GGUF experts (see the module doc)."""

    def __init__(self, mlp: MoEMLP, w: LayerWeights, cfg: ModelConfig, sms: int, device):
        self.gemv, self.topk, self.gate_up, self.down = (
            ops.bind(name, device) for name in
            ("decode_gemv", "moe_topk_softmax", "moe_q8_gate_up", "moe_q8_down"))
        self.mlp = mlp
        self.max_tokens = MAX_TOKENS
        self.q13, self.q2 = mlp.qtypes
        self.inter, self.top_k = cfg.moe.intermediate_size, cfg.moe.top_k
        self.renormalize = cfg.moe.renormalize
        router = one_matrix(w["router"])
        # decode_gemv reads a plain float router whose rows are whole 16-byte groups
        self.router = router if (router is not None and hasattr(router, "data_ptr")
                                 and router.shape[0] % 8 == 0 and router.is_contiguous()
                                 and str(router.dtype) == "torch.bfloat16") else None
        self.group = router_group(cfg.moe.num_experts, cfg.hidden_size, sms)
        self.variant = ROUTER_GEMV_VARIANT

    def __call__(self, out: Array, x: Array, w: WorkViews, accumulate: bool) -> None:
        """out = the MoE MLP of the normed x (accumulate: out += it); T <= MAX_TOKENS."""
        m, t = self.mlp, x.shape[0]
        if self.router is not None and t <= GEMV_MAX_TOKENS:
            self.gemv(w.router_logits, x, self.router, None, None, 0.0, self.group, self.variant)
        else:
            m.router(w.router_logits, x)
        self.topk(w.topk_weights, w.topk_ids, w.router_logits, self.renormalize)
        if m.offload is not None:     # an in-format expert cache: the same two kernels
            m.offload(out, x, w.topk_ids, w.topk_weights, w.moe_workspace, accumulate)
        else:
            act = step_act(w.moe_workspace, t * self.top_k, self.inter)
            self.gate_up(act, x, m.w13, self.q13, w.topk_ids, m.expert_map, GATE_UP_ROWS, PDL)
            self.down(out, act, m.w2, self.q2, w.topk_ids, w.topk_weights, m.expert_map,
                      accumulate, DOWN_ROWS, PDL)
        if m.shared is not None:
            m.add_shared(out, x, w)
