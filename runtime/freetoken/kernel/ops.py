"""Thin typed wrappers over the registry kernels: outputs are allocated by the caller.

Every wrapper finds the kernel for the tensors' device through ``get_function`` (cached per
device), so the model code never names a target. Shapes below use T = tokens, H = heads,
D = head dim, S = KV slots (pages * page size), B = sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken.kernel.loader import get_function

if TYPE_CHECKING:
    import torch

# GGML tensor type ids (gguf.GGMLQuantizationType) that the quantized kernels read.
Q4_0, Q4_1, Q8_0 = 2, 3, 8


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out[T, D] = x / rms(x) * weight; x rows contiguous, weight [D] of x's dtype."""
    get_function("norm", "rms_norm", x.device)(out, x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual += x; x = rms_norm(residual) * weight (both [T, D])."""
    get_function("norm", "fused_add_rms_norm", x.device)(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool) -> None:
    """In place on q [T, Hq*D] and k [T, Hk*D]; positions int64 [T];
    cos_sin_cache f32 [max_pos, rot_dim] = cat(cos, sin) over rot_dim/2 frequencies each;
    the first rot_dim of each head rotate (neox: halves, else interleaved pairs)."""
    get_function("rotary", "rotary_embedding", q.device)(
        positions, q, k, cos_sin_cache, head_dim, is_neox)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out[T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d]."""
    get_function("activation", "silu_and_mul", x.device)(out, x)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v); k [T, Hk, D], caches [S, Hk, D];
    slot_mapping int64 [T], a negative slot is skipped."""
    get_function("kv_cache", "store_kv", k.device)(k, v, k_cache, v_cache, slot_mapping)


def embedding(out: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> None:
    """out[T, D] = table[ids]; ids int64 [T]. An id outside the table raises on CPU; on the GPU
    it writes a zero row (raising would need a device sync)."""
    get_function("embedding", "embedding", table.device)(out, ids, table)


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, block_size: int, scale: float,
                    sliding_window: int = 0, workspace: torch.Tensor | None = None) -> None:
    """Causal attention of new tokens over the paged pool (K/V already stored).

    q, out [T, Hq, D]; caches [S, Hk, D] with S = num_blocks * block_size; block_tables int32
    [B, max_blocks]; seq_lens int32 [B] = tokens in the sequence after this step;
    query_start_loc int32 [B+1] = offsets of each sequence's new tokens in q. The i-th new token
    of sequence b sits at position seq_lens[b] - q_len_b + i and sees keys 0..that position
    (only the last `sliding_window` of them when it is > 0). GQA: Hq is a multiple of Hk.
    workspace: optional contiguous f32 scratch on q's device (CUDA decode splits long contexts
    across blocks with it; 1M floats covers every decode batch; None is correct, just slower).
    """
    fn = get_function("attention", "paged_attention", q.device)
    if workspace is None:
        fn(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
           sliding_window)
    else:
        fn(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
           sliding_window, workspace)


def quant_matmul(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """out[M, N] f32 = x[M, K] f32 @ dequant(qweight).T; qweight uint8 [N, row_bytes] holds
    GGUF blocks of one weight row per row (Q4_0, Q4_1 or Q8_0; K a multiple of 32)."""
    get_function("quant_gemm", "quant_matmul", x.device)(out, x, qweight, qtype)


def dequantize_rows(out: torch.Tensor, ids: torch.Tensor, qweight: torch.Tensor,
                    qtype: int) -> None:
    """out[T, K] f32 = dequant(qweight[ids]) (a quantized embedding lookup)."""
    get_function("quant_gemm", "dequantize_rows", qweight.device)(out, ids, qweight, qtype)


def cpu_isa() -> str:
    """The instruction set the CPU quantized kernels dispatch to: avx512, avx2 or scalar."""
    return str(get_function("quant_gemm", "cpu_isa", "cpu")())


def sample_tokens(out_ids: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor, top_p: torch.Tensor, seed: int, offset: int) -> None:
    """GPU sampling, one token per row of logits f32 [B, V] into out_ids int64 [B].

    Greedy (argmax, lowest index on ties) where temperature <= 0; otherwise softmax(logits / T)
    limited to the top_k most likely tokens (0 or >= V: no limit), then to the smallest set whose
    renormalised probability reaches top_p (>= 1: no limit). Philox4x32-10 keyed by seed with
    counter (row, offset): the same seed and offset give the same tokens (change offset every
    step). No host sync and no allocation, so it can run inside a CUDA graph. temperature f32,
    top_k int32 and top_p f32 are [B] tensors on the logits' device.
    """
    get_function("sampling", "sample_tokens", logits.device)(
        out_ids, logits, temperature, top_k, top_p, seed, offset)


# ---- MoE -------------------------------------------------------------------------------------
# E = experts, K = experts per token, I = expert intermediate size, S = expert slots in w13/w2.

MOE_BLOCK_M = 64     # token rows per expert tile: each expert's rows are padded to a multiple


def moe_workspace_bytes(tokens: int, top_k: int, num_experts: int, intermediate: int,
                        dtype: int | str) -> int:
    """Scratch bytes ``moe_experts`` may use for a step of `tokens` tokens (both backends
    honour it; the CPU needs less). Room for the (token, k) pairs sorted by expert and padded
    per expert to MOE_BLOCK_M rows, their int32 bookkeeping, and the f32 gate/up products.

    dtype: the activations' itemsize in bytes or a dtype name (float32, bfloat16, float16)."""
    itemsize = dtype if isinstance(dtype, int) else (4 if "32" in str(dtype) else 2)
    padded = tokens * top_k + num_experts * (MOE_BLOCK_M - 1)
    blocks = -(-padded // MOE_BLOCK_M)
    ints = 4 * (padded + 2 * (num_experts + 1) + blocks)
    floats = padded * intermediate * (2 * 4 + itemsize)
    return -(-(ints + floats) // 256) * 256


def moe_topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor, logits: torch.Tensor,
                     renormalize: bool) -> None:
    """Router: topk_weights f32 [T, K], topk_ids int32 [T, K] from logits [T, E] (f32; on a
    GPU also bf16/f16, math in f32): softmax over E, the K largest probabilities in
    descending order (ties: lower expert id first), divided by their sum when `renormalize`
    (qwen3_moe norm_topk_prob, mixtral) or kept as softmax values (qwen2_moe, olmoe)."""
    get_function("moe", "moe_topk_softmax", logits.device)(
        topk_weights, topk_ids, logits, renormalize)


def moe_experts(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor,
                workspace: torch.Tensor) -> None:
    """Routed SwiGLU experts: out[t] = sum_k topk_weights[t,k] *
    w2[s] @ (silu(w13[s,:I] @ x[t]) * (w13[s,I:] @ x[t])), s = expert_map[topk_ids[t,k]].

    x, out [T, H] of one dtype (f32 on the CPU; bf16/f16/f32 on a GPU); w13 [S, 2I, H] (gate
    rows, then up rows); w2 [S, H, I]; expert_map int32 [E] (0 <= slot < S); workspace uint8
    of at least moe_workspace_bytes(T, K, E, I, dtype) bytes. f32 accumulation; out is
    overwritten. No host sync and no allocation (capturable in a CUDA graph)."""
    get_function("moe", "moe_experts", x.device)(
        out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace)


def moe_experts_quant(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      qtype13: int, qtype2: int, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, expert_map: torch.Tensor,
                      workspace: torch.Tensor) -> None:
    """``moe_experts`` on the CPU over GGUF blocks: w13 uint8 [S, 2I, row_bytes13], w2 uint8
    [S, H, row_bytes2], one weight row per row, of GGML types Q4_0, Q4_1, Q8_0, F16 or F32."""
    get_function("moe", "moe_experts_quant", "cpu")(
        out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights, expert_map, workspace)
