"""Prefill over GGUF weights on a GPU: a step of more than MIN_TOKENS tokens (routed experts:
EXPERT_MIN_TOKENS) dequantizes the weight it multiplies, right before the product, into one bf16 scratch buffer the device shares,
and runs the float product there (cuBLAS; for routed experts the grouped expert GEMM of
moe_experts, a chunk of experts at a time). The weights stay in their blocks; only the scratch
holds floats, and only during the product. The dequantizing pass reads each weight's blocks
once and writes bf16 in 16-byte stores: at a prompt of hundreds of tokens the tensor-core
product then costs what a bf16 model's does, where the block GEMM (gguf_matmul) decodes every
tile's weights again for every 64 rows of x. Decode steps keep the GEMVs on the blocks.

The scratch holds the largest dense projection of the model, or EXPERT_CHUNK experts of an MoE
layer (gate, up and down), whichever is larger (scratch_elements); the memory plan counts it
in the workspace (engine/offload_setup.py).
"""

from __future__ import annotations

from typing import Any

# A dense product of more than this many tokens dequantizes: on an H100 (8-layer Qwen3-8B in
# Q4_K_M, benchmarks/results/h100-gpu_vs_llamacpp-qwen3-8b-q4km-first.log) gguf_gemv's bf16
# dots took 6.2 ms a step at 8 tokens and gguf_matmul's tiles 14.6 ms at 32, where the
# dequantizing pass plus cuBLAS moves ~8x the block bytes once (~4 ms). Steps that
# gguf_gemv_q8 takes (up to 8 tokens for Q4_K, Q6_K and Q8_0, linear.QuantLinear) never get here.
MIN_TOKENS = 4
# Routed experts: steps of up to moe_decode_quant.MAX_TOKENS stream each routed pair's expert
# (moe_q8_*); wider ones dequantize EXPERT_CHUNK experts per moe_experts call.
EXPERT_MIN_TOKENS = 32
EXPERT_CHUNK = 32


def scratch_elements(cfg) -> int:
    """bf16 elements of the scratch a GGUF model on a GPU needs: its largest dense projection
    (the head excluded: prefill runs it on the last tokens only), or EXPERT_CHUNK experts."""
    h, kv = cfg.hidden_size, 2 * cfg.kv_size
    dense = [h * (cfg.q_size + kv), h * cfg.q_size]
    if cfg.intermediate_size:
        dense += [2 * h * cfg.intermediate_size]
    linear = getattr(cfg, "linear", None)
    if linear is not None:
        dense += [h * linear.projection_size, h * linear.value_dim]
    moe = cfg.moe
    if moe is not None:
        dense.append(min(moe.num_experts, EXPERT_CHUNK) * 3 * h * moe.intermediate_size)
        if moe.shared_intermediate_size:
            dense.append(2 * h * moe.shared_intermediate_size)
    return max(dense)


class DequantScratch:
    """The device's one bf16 scratch, grown to the largest need registered; steps run one at a
    time on the device's stream, so every projection may use all of it."""

    _by_device: dict[str, DequantScratch] = {}

    def __init__(self, device: Any):
        self.device = device
        self.elements = 0
        self._buffer = None

    @classmethod
    def for_device(cls, device: Any) -> DequantScratch:
        """The one scratch of `device` ("cuda", "cuda:0" and torch.device("cuda", 0) alike)."""
        key = _device_key(device)
        if key not in cls._by_device:
            cls._by_device[key] = cls(key)
        return cls._by_device[key]

    def reserve(self, elements: int) -> None:
        """Room for `elements` bf16 values (allocated at the first product that needs it)."""
        self.elements = max(self.elements, elements)

    def allocate(self) -> None:
        """The buffer for every need registered so far (Decoder.reserve calls this before the
        engine sizes its KV pool from what is left)."""
        import torch

        if self.elements and (self._buffer is None or self._buffer.numel() < self.elements):
            self._buffer = None            # free the old buffer before the larger one
            self._buffer = torch.empty(self.elements, dtype=torch.bfloat16, device=self.device)

    def holds(self, elements: int) -> bool:
        return 0 < elements <= self.elements

    def take(self, *shape: int):
        """A bf16 view of `shape` (holds() it) at the start of the buffer, its previous
        contents lost."""
        count = 1
        for n in shape:
            count *= n
        self.allocate()
        return self._buffer[:count].view(*shape)


def _device_key(device: Any) -> str:
    """A device's canonical name: a CUDA device without an index is the current one."""
    import torch

    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


def dense_product(out, x, data, qtype: int, scratch: DequantScratch, dequantize) -> None:
    """out[T, N] = x[T, K] @ dequant(data).T through the scratch (out may be a column slice or
    float32: the product is written through a copy then)."""
    import torch

    n, k = out.shape[1], x.shape[1]
    weight = scratch.take(n, k)
    dequantize(weight, data, qtype)
    if out.is_contiguous() and out.dtype == x.dtype:
        torch.mm(x, weight.T, out=out)
    else:
        out.copy_(torch.mm(x, weight.T))


class ExpertChunks:
    """A prefill step's routed GGUF experts through the scratch: EXPERT_CHUNK slots at a time
    dequantized (gate/up rows, then down rows), then moe_experts over that chunk with an expert
    map that keeps only its slots (the others' pairs are skipped), the chunks' outputs summed
    in float32."""

    def __init__(self, w13, w2, qtypes: tuple[int, int], device):
        from freetoken.kernel import ops

        self.w13, self.w2 = w13, w2          # uint8 [S, 2I, pitch], [S, H, pitch]
        self.q13, self.q2 = qtypes
        self.slots, self.inter, self.hidden = w13.shape[0], w13.shape[1] // 2, w2.shape[1]
        self.chunk = min(self.slots, EXPERT_CHUNK)
        self.scratch = DequantScratch.for_device(device)
        self.dequantize = ops.bind("gguf_dequantize", device)
        self.experts = ops.bind("moe_experts", device)

    def applies(self, tokens: int) -> bool:
        per_expert = 3 * self.hidden * self.inter
        return tokens > EXPERT_MIN_TOKENS and self.scratch.holds(self.chunk * per_expert)

    def __call__(self, out, x, topk_ids, topk_weights, expert_map, workspace) -> None:
        import torch

        two_i, h, inter = 2 * self.inter, self.hidden, self.inter
        total = None if self.chunk == self.slots else torch.zeros(out.shape, dtype=torch.float32,
                                                                    device=out.device)
        for s0 in range(0, self.slots, self.chunk):
            n = min(self.chunk, self.slots - s0)
            buf = self.scratch.take(n * 3 * h * inter)
            w13 = buf[:n * two_i * h].view(n, two_i, h)
            w2 = buf[n * two_i * h:].view(n, h, inter)
            self.dequantize(w13.view(n * two_i, h),
                            self.w13[s0:s0 + n].view(n * two_i, -1), self.q13)
            self.dequantize(w2.view(n * h, inter), self.w2[s0:s0 + n].view(n * h, -1), self.q2)
            if total is None:
                self.experts(out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace)
                return
            inside = (expert_map >= s0) & (expert_map < s0 + n)
            chunk_map = torch.where(inside, expert_map - s0, torch.full_like(expert_map, -1))
            self.experts(out, x, w13, w2, topk_ids, topk_weights, chunk_map, workspace)
            total += out.float()
        out.copy_(total)
