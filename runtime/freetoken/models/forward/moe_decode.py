"""The GPU MoE decode step for small batches (T <= MAX_TOKENS): four launches per MoE layer
after its normed input, against 5-6 on the general path (plus 6 for a shared expert):

    decode_gemv          router logits (16-byte loads, rows split to fill the SMs; the layer's
                         own linear when the expert count is not a multiple of 8)
    moe_topk_softmax     softmax, top-k, norm_topk_prob renormalisation (one warp per token)
    moe_decode_gate_up   SwiGLU of every routed expert, each read once, + the shared expert
                         and its sigmoid-gate logit
    moe_decode_down      weighted combine over the token's k experts + the gated shared expert,
                         written as the MLP output or added to the residual stream

The rule (decided once at load, per layer): a CUDA/ROCm device, bf16/f16 activations, the
experts stored as plain float tensors (not GGUF blocks, not FP8/NVFP4, which keep their own
kernels), H, I and Is multiples of 8, top_k <= 16, at most 1024 experts, and
FREETOKEN_FUSED_DECODE on. Per step: no expert offload cache attached (its host-side slot
bookkeeping keeps the moe_experts path) and T <= the layer's max_tokens, from the H200 per-layer
times (benchmarks/moe_decode_kernels.py): 1 token always (Qwen3-30B-A3B 50.4 -> 44.9 us,
Qwen3.6-35B-A3B 74.4 -> 39.2 us); 2 tokens only for experts of I <= NARROW_INTER (Qwen3.6's
512: 84.4 -> 63.0 us; Qwen3-30B's 768 lost, 68.6 -> 80.4 us); from 4 tokens moe_experts' grouped
GEMMs win (T = 8: 0.45-0.53x), so those steps keep it. The kernels take up to MAX_TOKENS.
Ids stay on the device: no host sync, graph-capturable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken.kernel import ops
from freetoken.models.batch import Array
from freetoken.models.forward.workspace import WorkViews

if TYPE_CHECKING:
    from freetoken.models.checkpoint.weights import LayerWeights
    from freetoken.models.config import ModelConfig
    from freetoken.models.forward.mlp import MoEMLP

MAX_TOKENS = 8          # what the kernels take (kernels/cuda/moe_decode.cu kMaxTokens)
NARROW_INTER = 640      # experts at most this wide also take 2-token steps (see the doc)
VARIANTS = 7            # launch shapes both kernels take (moe_decode_kernels.cuh kVariants)
# The launch variants decode runs (benchmarks/moe_decode_kernels.py times them all on the H200;
# us per layer, gate/up + down in one graph, benchmarks/results/h200-moe_decode_kernels-0e9c8a0.txt):
# - 1 token: the streamed kinds (moe_decode_kernels.cuh kVariants). Gate/up variant 5 (one wave
#   of 2 blocks per SM) took Qwen3-30B-A3B 21.1 -> 19.3 us; down variant 6 (2 dots of 3 loads
#   per lane in flight; its 4-dot siblings spill) 20.5 -> 12.8 us and Qwen3.6 16.4 -> 12.5,
#   launched as a programmatic dependent of gate/up.
# - 2 tokens: down variant 2 (two rows per warp), 37.6 -> 24.3 us (d1cf359); streamed gate/up
#   lost there (38.7 -> 40.3 us), and Qwen3.6's down stayed faster on 2 (19.3 vs 21.7 us).
# Older findings: a down staging the activations in shared memory lost (97902f5), and so did
# routing inside gate/up's prologue, every block running the top-k itself (29.2 us against
# 4.8 + 21.0 on Qwen3-30B-A3B, a608e1a).
GATE_UP_VARIANT = {1: 5}    # tokens -> gate/up's variant; absent: 0
DOWN_VARIANT = {1: 6, 2: 2}  # tokens -> down's variant; absent: 0
ROUTER_GEMV_VARIANT = 0  # decode_gemv launch variant of the router (fused_decode.GEMV_VARIANTS)
MAX_TOP_K = 16
MAX_EXPERTS = 1024


def _plain(t) -> bool:
    """A float tensor the kernels read directly: contiguous, 16-byte aligned, last dim % 8."""
    return (hasattr(t, "is_contiguous") and t.is_contiguous() and t.data_ptr() % 16 == 0
            and t.shape[-1] % 8 == 0)


def one_matrix(weight):
    """The one matrix of a fused entry (the loader stores fused rows as a list of parts)."""
    if isinstance(weight, list):
        return weight[0] if len(weight) == 1 else None
    return weight


def eligible(cfg: ModelConfig, mlp: MoEMLP, w: LayerWeights, dtype: str, device) -> bool:
    """The load-time rule of the module doc, for one MoE layer."""
    from freetoken import env

    settings = env.read()
    if (device.is_cpu or dtype not in ("bfloat16", "float16") or not settings.fused_decode
            or not settings.moe_decode):
        return False
    moe = cfg.moe
    if mlp.scaled is not None or mlp.qtypes or moe.top_k > MAX_TOP_K:
        return False
    if moe.num_experts > MAX_EXPERTS:
        return False
    weights = [mlp.w13, mlp.w2, one_matrix(w["router"])]
    if mlp.shared is not None:
        weights += [one_matrix(w["shared.gate_up"]), w["shared.down"]]
        if w.get("shared_gate") is not None:
            weights.append(w["shared_gate"])
    if not all(x is not None and _plain(x) for x in weights):
        return False
    if any(str(x.dtype).replace("torch.", "") != dtype for x in weights):
        return False
    return cfg.hidden_size % 8 == 0 and mlp.w13.shape[1] % 16 == 0


def max_tokens(inter: int) -> int:
    """The widest step a layer with experts of width `inter` runs here (the doc's rule)."""
    return 2 if inter <= NARROW_INTER else 1


def router_group(experts: int, hidden: int, sms: int) -> int:
    """decode_gemv's threads per router row: fused_decode's rule (fill the SMs, split K)."""
    from freetoken.models.forward.fused_decode import gemv_group

    return gemv_group(experts, hidden, sms)


class MoEDecode:
    """One MoE layer's small-step decode (see the module doc)."""

    def __init__(self, mlp: MoEMLP, w: LayerWeights, cfg: ModelConfig, sms: int, device):
        self.gemv, self.topk, self.gate_up, self.down = (
            ops.bind(name, device) for name in
            ("decode_gemv", "moe_topk_softmax", "moe_decode_gate_up", "moe_decode_down"))
        self.mlp = mlp
        self.max_tokens = max_tokens(mlp.w2.shape[-1])
        self.router = one_matrix(w["router"])
        self.renormalize = cfg.moe.renormalize
        self.group = router_group(self.router.shape[0], cfg.hidden_size, sms)
        # decode_gemv writes 16-byte aligned rows: 60 experts (Qwen1.5-MoE) take the mm
        self.gemv_router = self.router.shape[0] % 8 == 0
        self.shared_w13 = self.shared_w2 = self.gate_w = None
        if mlp.shared is not None:
            self.shared_w13, self.shared_w2 = one_matrix(w["shared.gate_up"]), w["shared.down"]
            gate = w.get("shared_gate")
            if gate is not None:
                self.gate_w = gate.reshape(1, -1) if gate.dim() == 1 else gate

    def __call__(self, out: Array, x: Array, w: WorkViews, accumulate: bool) -> None:
        """out = the MoE MLP of the normed x (accumulate: out += it); T <= max_tokens."""
        m = self.mlp
        if self.gemv_router:
            self.gemv(w.router_logits, x, self.router, None, None, 0.0, self.group,
                      ROUTER_GEMV_VARIANT)
        else:
            m.router(w.router_logits, x)
        self.topk(w.topk_weights, w.topk_ids, w.router_logits, self.renormalize)
        shared = self.shared_w13 is not None
        act = w.shared_act if shared else None
        gate = w.shared_gate if self.gate_w is not None else None
        self.gate_up(x, m.w13, m.w2, w.topk_ids, m.expert_map, w.moe_workspace, self.shared_w13,
                     act, self.gate_w, gate, GATE_UP_VARIANT.get(x.shape[0], 0))
        self.down(out, m.w13, m.w2, w.topk_ids, w.topk_weights, m.expert_map, w.moe_workspace,
                  self.shared_w2, act, gate, accumulate, DOWN_VARIANT.get(x.shape[0], 0))


def attach(layers: list, weights: list, cfg: ModelConfig, dtype: str, arrays) -> int:
    """Give every eligible MoE layer of a decoder its small-step decode (layer.mlp.decode):
    MoEDecode over float experts, moe_decode_quant.QuantMoEDecode over GGUF ones; returns how
    many got one. Only arrays on a real GPU qualify (host tensors may stand in for a GPU
    placement in tests)."""
    from freetoken.models.forward import moe_decode_quant
    from freetoken.models.forward.mlp import MoEMLP

    kinds = []
    for layer, lw in zip(layers, weights):
        mlp = layer.mlp
        if not isinstance(mlp, MoEMLP):
            continue
        if eligible(cfg, mlp, lw, dtype, arrays.device):
            kinds.append((mlp, lw, MoEDecode))
        elif moe_decode_quant.eligible(cfg, mlp, dtype, arrays.device):
            kinds.append((mlp, lw, moe_decode_quant.QuantMoEDecode))
    if not kinds:
        return 0
    import torch

    where = torch.device(getattr(arrays, "torch_device", "cpu"))
    if where.type != "cuda":
        return 0
    sms = torch.cuda.get_device_properties(where).multi_processor_count
    for mlp, lw, kind in kinds:
        mlp.decode = kind(mlp, lw, cfg, sms, arrays.device)
    return len(kinds)
