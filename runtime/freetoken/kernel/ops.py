"""Thin typed wrappers over the registry kernels: outputs are allocated by the caller.

Two ways in, one mechanism: ``bind(name, device)`` resolves the kernel function behind a
wrapper once, for code that calls it in a hot loop (the models); the wrappers below do the same
look-up per call (memoized by the loader, a few microseconds). Both find the kernel that exports
``name`` in the registry, so a new wrapper is one line calling ``_fn(name, device)``.
Shapes below use T = tokens, H = heads, D = head dim, S = KV slots (pages * page size),
B = sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from freetoken.csrc.build import registry  # the one registry of this process
from freetoken.kernel.loader import get_function

if TYPE_CHECKING:
    import torch

# GGML tensor type ids (gguf.GGMLQuantizationType) that the quantized kernels read.
Q4_0, Q4_1, Q8_0 = 2, 3, 8

# Exported function -> the kernel that exports it (the first one, for a shared helper).
KERNEL_OF: dict[str, str] = {}
for _kernel in registry.KERNELS:
    for _name in _kernel.functions + _kernel.cpu_functions:
        KERNEL_OF.setdefault(_name, _kernel.name)
del _kernel, _name


def _fn(name: str, device: Any) -> Callable:
    return get_function(KERNEL_OF[name], name, device)


def bind(name: str, device: Any) -> Callable:
    """The function behind ``ops.<name>`` on `device`, resolved now, with the wrapper's arguments.

    A wrapper that a test replaced on this module (e.g. with ``reference.<name>``) is returned
    as it is, so the models run the replacement too.
    """
    wrapper = globals().get(name)
    if wrapper is None or name not in KERNEL_OF:
        raise KeyError(f"no kernel function {name!r}; known: {', '.join(sorted(KERNEL_OF))}")
    if getattr(wrapper, "__module__", None) != __name__:
        return wrapper
    return _fn(name, device)


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """out[T, D] = x / rms(x) * weight; x rows contiguous, weight [D] of x's dtype."""
    _fn("rms_norm", x.device)(out, x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual += x; x = rms_norm(residual) * weight (both [T, D])."""
    _fn("fused_add_rms_norm", x.device)(x, residual, weight, eps)


def rms_norm_gated(out: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> None:
    """out = rms_norm(x) * weight * silu(z), normed over each weight-wide group of a row (the
    Gated DeltaNet output norm: one group per value head); out, x, z [T, W] (rows may be
    strided; out may be x), weight [G] with G dividing W. The norm is rounded to the dtype
    before the gate multiplies it, and the product once."""
    _fn("rms_norm_gated", x.device)(out, x, z, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int, is_neox: bool) -> None:
    """In place on q [T, Hq*D] and k [T, Hk*D]; positions int64 [T];
    cos_sin_cache f32 [max_pos, rot_dim] = cat(cos, sin) over rot_dim/2 frequencies each;
    the first rot_dim of each head rotate (neox: halves, else interleaved pairs)."""
    _fn("rotary_embedding", q.device)(
        positions, q, k, cos_sin_cache, head_dim, is_neox)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out[T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d]."""
    _fn("silu_and_mul", x.device)(out, x)


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """out[T, d] = gelu_tanh(x[:, :d]) * x[:, d:] for x [T, 2d] (Gemma's MLP gate)."""
    _fn("gelu_tanh_and_mul", x.device)(out, x)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[slot_mapping[t]] = k[t] (same for v); k [T, Hk, D], caches [S, Hk, D];
    slot_mapping int64 [T], a negative slot is skipped."""
    _fn("store_kv", k.device)(k, v, k_cache, v_cache, slot_mapping)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """store_kv into the FP8 pool: k, v [T, Hk, D] (f32, f16 or bf16; rows may be strided);
    k_cache, v_cache uint8 [S, Hk, D] of e4m3fn codes and k_scale, v_scale float32 [S, Hk],
    so that row (s, h) reads code[s, h, i] * scale[s, h]. Each written row gets scale =
    max |x| / 448 (1 for an all-zero row) and codes e4m3(x / scale), rounded to nearest even
    (kernels/include/freetoken/fp8_encode.h: the CPU and GPU store the same bytes);
    slot_mapping int64 [T], a negative slot is skipped."""
    _fn("store_kv_fp8", k.device)(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def embedding(out: torch.Tensor, ids: torch.Tensor, table: torch.Tensor) -> None:
    """out[T, D] = table[ids]; ids int64 [T]. An id outside the table raises on CPU; on the GPU
    it writes a zero row (raising would need a device sync)."""
    _fn("embedding", table.device)(out, ids, table)


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
    fn = _fn("paged_attention", q.device)
    if workspace is None:
        fn(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
           sliding_window)
    else:
        fn(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
           sliding_window, workspace)


def paged_attention_fp8(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, block_size: int, scale: float,
                        sliding_window: int = 0, workspace: torch.Tensor | None = None) -> None:
    """paged_attention over the FP8 pool that store_kv_fp8 writes: k_cache, v_cache uint8
    [S, Hk, D] of e4m3fn codes, k_scale, v_scale float32 [S, Hk]; key/value row (s, h) is
    code[s, h, :] * scale[s, h]. q and out bf16 or f16 on the GPU; the rest as paged_attention
    (workspace included)."""
    fn = _fn("paged_attention_fp8", q.device)
    if workspace is None:
        fn(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
           block_size, scale, sliding_window)
    else:
        fn(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc,
           block_size, scale, sliding_window, workspace)


def quant_matmul(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """out[M, N] f32 = x[M, K] f32 @ dequant(qweight).T; qweight uint8 [N, row_bytes] holds
    GGUF blocks of one weight row per row (Q4_0, Q4_1 or Q8_0; K a multiple of 32)."""
    _fn("quant_matmul", x.device)(out, x, qweight, qtype)


def quant_pack(out: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """CPU: out (uint8, qweight's shape) = qweight's GGUF rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q4_K or Q6_K; rows a multiple of 16) packed 16 rows wide for AVX-512 VNNI (kernels/include/freetoken/quant_packed.h).
    Raises on a CPU without AVX-512 VNNI."""
    _fn("quant_pack", qweight.device)(out, qweight, qtype)


def quant_matmul_packed(out: torch.Tensor, x: torch.Tensor, packed: torch.Tensor,
                        qtype: int) -> None:
    """quant_matmul over weights that quant_pack wrote."""
    _fn("quant_matmul_packed", x.device)(out, x, packed, qtype)


def float_matmul(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """CPU: out[M, N] f32 = x[M, K] f32 @ w[N, K].T, w float32, float16 or bfloat16, on the
    kernels' thread pool (decode-sized products; BLAS serves large ones)."""
    _fn("float_matmul", x.device)(out, x, w)


def dequantize_rows(out: torch.Tensor, ids: torch.Tensor, qweight: torch.Tensor,
                    qtype: int) -> None:
    """out[T, K] f32 = dequant(qweight[ids]) (a quantized embedding lookup)."""
    _fn("dequantize_rows", qweight.device)(out, ids, qweight, qtype)


def gguf_matmul(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """GPU: out[M, N] (bf16 or f32) = x[M, K] bf16 @ dequant(qweight).T; qweight uint8
    [N, row_bytes] holds GGUF blocks of one weight row per row: Q4_0 (2), Q4_1 (3), Q5_0 (6),
    Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13) or Q6_K (14). out rows may be a column slice of a
    wider buffer. M <= 8 runs a GEMV, larger M a tiled tensor-core GEMM; no allocation, no host
    sync."""
    _fn("gguf_matmul", x.device)(out, x, qweight, qtype)


def gguf_gemv(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int,
              rows: int = 0) -> None:
    """GPU decode product (x rows T <= 8) as gguf_matmul, for Q4_0/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K rows
    whose byte length is a multiple of 16: 16-byte coalesced loads, `rows` weight rows per warp
    (1, 2 or 4; 0 picks by T). out bf16 or f32, rows may be a column slice."""
    _fn("gguf_gemv", x.device)(out, x, qweight, qtype, rows)


def gguf_gemv_q8(out: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, qtype: int,
                 bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 eps: float = 0.0, mode: int = 0, rows: int = 0, pdl: bool = False) -> None:
    """GPU decode product over GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K rows of whole 16-byte words
    (x rows T <= 2; T * K <= 32768 for Q4_K, 24576 for the others) on int8 activations that each
    block quantizes from x (RMS-normed by norm_weight when given). mode 0: out = xn @ W.T
    (+ bias), bf16 or f32, may be a column slice; 1: out (the bf16 residual) += xn @ W.T; 2: out
    = silu(g) * u for [g | u] = xn @ W.T, W [2I, K]. rows: Q4_K weight rows per warp (0 by T,
    1, 2); pdl: launch as a programmatic dependent where the GPU has it."""
    _fn("gguf_gemv_q8", x.device)(out, x, qweight, qtype, bias, norm_weight, eps, mode, rows,
                                  pdl)


def moe_q8_gate_up(act: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, qtype: int,
                   topk_ids: torch.Tensor, expert_map: torch.Tensor, rows: int = 0,
                   pdl: bool = False) -> None:
    """GPU MoE decode, first half: act[t * K + k] (bf16 [T * K, I]) = silu(gate) * up of
    token t's k-th routed expert (slot expert_map[topk_ids[t, k]]; zeros without a slot) over
    GGUF experts w13 uint8 [S, 2I, row_bytes] of qtype, on int8 activations of x (bf16 [T, H],
    any T). rows: Q4_K weight rows per warp (0/1 one, 2 two)."""
    _fn("moe_q8_gate_up", x.device)(act, x, w13, qtype, topk_ids, expert_map, rows, pdl)


def moe_q8_down(out: torch.Tensor, act: torch.Tensor, w2: torch.Tensor, qtype: int,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor,
                accumulate: bool = False, rows: int = 0, pdl: bool = False) -> None:
    """GPU MoE decode, second half: out[t] (bf16 [T, H]; += with accumulate) = sum over k of
    topk_weights[t, k] * w2[slot] @ act[t * K + k], w2 uint8 [S, H, row_bytes] of qtype (I a
    multiple of 256 for Q4_K; K * I within the kernel's staging)."""
    _fn("moe_q8_down", act.device)(out, act, w2, qtype, topk_ids, topk_weights, expert_map,
                                   accumulate, rows, pdl)


def gguf_dequantize(out: torch.Tensor, qweight: torch.Tensor, qtype: int) -> None:
    """GPU: out[N, K] (bf16, contiguous) = dequant(qweight), qweight uint8 [N, row_bytes] of
    GGUF blocks (rows padded to 16 bytes or not): a prefill product's weight in the scratch."""
    _fn("gguf_dequantize", qweight.device)(out, qweight, qtype)


def gguf_dequantize_rows(out: torch.Tensor, ids: torch.Tensor, qweight: torch.Tensor,
                         qtype: int) -> None:
    """GPU: out[T, K] (bf16 or f32) = dequant(qweight[ids]), the quantized embedding lookup
    (types as gguf_matmul); an id outside the table writes a zero row."""
    _fn("gguf_dequantize_rows", qweight.device)(out, ids, qweight, qtype)


def set_num_threads(threads: int) -> None:
    """Size the CPU quantized kernels' thread pool (0 = every core)."""
    _fn("set_num_threads", "cpu")(threads)


def cpu_isa() -> str:
    """The instruction set the CPU quantized kernels dispatch to: avx512, avx2 or scalar."""
    return str(_fn("cpu_isa", "cpu")())


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
    _fn("sample_tokens", logits.device)(
        out_ids, logits, temperature, top_k, top_p, seed, offset)


def moe_topk_softmax(topk_weights: torch.Tensor, topk_ids: torch.Tensor, logits: torch.Tensor,
                     renormalize: bool) -> None:
    """MoE routing: softmax over the router logits [T, E] in f32, then the K most likely experts
    in descending order (ties: lower id) into topk_weights f32 [T, K] and topk_ids int32 [T, K];
    renormalize divides the K weights by their sum. GPU logits may be bf16/f16/f32; E <= 512,
    K <= 16."""
    get_function("moe", "moe_topk_softmax", logits.device)(
        topk_weights, topk_ids, logits, bool(renormalize))


def moe_experts(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor,
                workspace: torch.Tensor) -> None:
    """The routed experts' SwiGLU MLPs, combined (out is overwritten):

        out[t] = sum_k topk_weights[t, k] * w2[s] @ (silu(w13[s, :I] @ x[t]) * (w13[s, I:] @ x[t]))

    with s = expert_map[topk_ids[t, k]]. x, out [T, H]; w13 [S, 2I, H] (gate rows, then up
    rows); w2 [S, H, I]; topk_ids int32 [T, K]; topk_weights f32 [T, K]; expert_map int32 [E]
    (0 <= slot < S; on the GPU a pair whose id or slot is out of range contributes nothing, since
    raising would need a device sync). workspace: contiguous uint8 [>= moe_workspace_bytes(...)]
    on x's device (the CPU kernel needs none and accepts any size, even 0). On the GPU: no host
    sync and no allocation, so it is capturable in a CUDA graph.
    """
    get_function("moe", "moe_experts", x.device)(
        out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace)


# The GPU experts kernel's plan (kernels/cuda/moe.cu make_plan): keep the two in step.
_MOE_GEMV_MAX_PAIRS, _MOE_GEMV_ROWS, _MOE_TILE_ROWS = 256, 8, 64
_ITEMSIZE = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def _align256(n: int) -> int:
    return (n + 255) // 256 * 256


def moe_workspace_bytes(num_tokens: int, top_k: int, num_experts: int, intermediate: int,
                        itemsize) -> int:
    """Bytes of `workspace` that moe_experts needs for these sizes (any backend honours it).

    itemsize: bytes per element of x (2 or 4), a dtype name ("bfloat16") or a torch dtype.
    Layout: tile table (3 int32 per tile), pair ids sorted by expert (int32 per pair), the
    SwiGLU activations [pairs, I] in x's dtype and, for prefill-sized batches, one f32
    down-projection column chunk [pairs, max(round_up(I, 64), 512)].
    """
    size = _itemsize(itemsize)
    pairs = num_tokens * top_k
    gemv = pairs <= min(4 * num_experts, _MOE_GEMV_MAX_PAIRS)
    tile = _MOE_GEMV_ROWS if gemv else _MOE_TILE_ROWS
    max_tiles = -(-pairs // tile) + min(num_experts, pairs)
    y_cols = max(-(-intermediate // 64) * 64, 512)
    total = (_align256(12 * max_tiles) + _align256(4 * pairs)
             + _align256(size * pairs * intermediate))
    return total + (0 if gemv else _align256(4 * pairs * y_cols))


def _itemsize(itemsize) -> int:
    if isinstance(itemsize, int):
        if itemsize not in (2, 4):
            raise ValueError(f"itemsize must be 2 or 4 bytes, got {itemsize}")
        return itemsize
    if isinstance(itemsize, str):
        if itemsize not in _ITEMSIZE:
            raise ValueError(f"itemsize: unknown dtype name {itemsize!r}; "
                             f"known: {', '.join(_ITEMSIZE)}")
        return _ITEMSIZE[itemsize]
    size = getattr(itemsize, "itemsize", None)
    if size not in (2, 4):
        raise ValueError(f"itemsize must be 2, 4, a dtype name or a float dtype, got {itemsize!r}")
    return size


def moe_experts_quant(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      qtype13: int, qtype2: int, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor, expert_map: torch.Tensor,
                      workspace: torch.Tensor) -> None:
    """``moe_experts`` on the CPU over GGUF rows: out/x f32 [T, H]; w13 uint8 [S, 2I, row_bytes]
    and w2 uint8 [S, H, row_bytes] hold one weight row per row in GGML type qtype13 / qtype2:
    Q4_0 (2), Q4_1 (3), Q8_0 (8) (H and I multiples of 32), F16 (1), BF16 (30) or F32 (0)."""
    get_function("moe", "moe_experts_quant", "cpu")(
        out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights, expert_map, workspace)


def moe_experts_quant_packed(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor,
                             w2: torch.Tensor, qtype13: int, qtype2: int, packed13: bool,
                             packed2: bool, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                             expert_map: torch.Tensor, workspace: torch.Tensor) -> None:
    """``moe_experts_quant`` where w13 (packed13) and/or w2 (packed2) hold rows that quant_pack
    rewrote (viewed as [S * rows, row_bytes]), any type quant_pack takes, I and H multiples of
    16, on an AVX-512 VNNI CPU."""
    get_function("moe", "moe_experts_quant_packed", "cpu")(
        out, x, w13, w2, qtype13, qtype2, packed13, packed2, topk_ids, topk_weights, expert_map,
        workspace)


def gdn_conv1d(out: torch.Tensor, x: torch.Tensor, conv_state: torch.Tensor,
               weight: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
               state_slots: torch.Tensor) -> None:
    """Gated DeltaNet's short causal conv: out[t, c] = silu(sum_j weight[c, j] *
    x[t - K + 1 + j, c]) per sequence, the K-1 inputs before a chunk read from
    conv_state[state_slots[b]] (zeros when the sequence's first new token is at position 0),
    which then holds the last K-1 inputs. out [T, C]; x [T, C] (rows may be strided);
    conv_state [N, C, K-1] and weight [C, K] of x's dtype; positions int64 [T];
    query_start_loc int32 [B+1]; state_slots int32 [B] (on the GPU a slot outside [0, N) is
    skipped). Prefill chunks and decode steps alike; no allocation (CUDA-graph safe)."""
    _fn("gdn_conv1d", x.device)(out, x, conv_state, weight, positions, query_start_loc,
                                state_slots)


def gdn_recurrence(out: torch.Tensor, qkv: torch.Tensor, ba: torch.Tensor,
                   a_log: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                   positions: torch.Tensor, query_start_loc: torch.Tensor,
                   state_slots: torch.Tensor) -> None:
    """The gated delta rule per value head h (key head h // (Hv / Hk)), token by token:
    q, k L2-normed (eps 1e-6), q scaled by dk^-0.5; beta = sigmoid(b); g = -exp(A_log) *
    softplus(a + dt_bias); S = exp(g) S; S += k (beta (v - k^T S))^T; out = q^T S.
    out [T, Hv*dv]; qkv [T, 2*Hk*dk + Hv*dv] (the conv output: q, k, v columns); ba [T, 2*Hv]
    (b then a; rows may be strided); a_log, dt_bias f32 [Hv]; ssm_state f32 [N, Hv, dk, dv],
    per slot as in gdn_conv1d. GPU: dk in {64, 128, 256}, dv a multiple of 4; a step with at
    least 64 tokens more than sequences runs the chunked form (equal within f32 rounding)."""
    _fn("gdn_recurrence", qkv.device)(out, qkv, ba, a_log, dt_bias, ssm_state, positions,
                                      query_start_loc, state_slots)


def decode_gemv(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                group: int, variant: int = 0) -> None:
    """GPU decode projection, T <= 8 tokens, bf16/f16: out[T, N] = xn @ weight[N, K].T (+ bias)
    with xn = rms_norm(x) * norm_weight when norm_weight is given (else x). `group` threads
    (32/64/128/256) share one output row: see forward/fused_decode.py's gemv_group. `variant`
    picks the compiled performance knobs (fused_decode.GEMV_VARIANTS; 0 the original): every
    variant gives the same result up to the f32 summation order."""
    _fn("decode_gemv", x.device)(out, x, weight, bias, norm_weight, eps, group, variant)


def decode_gemv_add(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                    group: int, variant: int = 0) -> None:
    """In place: residual[T, N] += x[T, K] @ weight.T, the product rounded to the dtype first."""
    _fn("decode_gemv_add", x.device)(residual, x, weight, group, variant)


def decode_gemv_swiglu(out: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor,
                       norm_weight: torch.Tensor | None, eps: float, group: int,
                       variant: int = 0) -> None:
    """out[T, I] = silu(g) * u where [g | u] = xn @ gate_up[2I, K].T (xn as in decode_gemv)."""
    _fn("decode_gemv_swiglu", x.device)(out, x, gate_up, norm_weight, eps, group, variant)


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, head_dim: int,
                  is_neox: bool) -> None:
    """rms_norm per head (when q_norm/k_norm are given), rotary_embedding, store_kv in one GPU
    launch: q [T, Hq*D] is rotated in place; k and v [T, Hk*D] are read, and k (rotated) and v
    land in the caches [S, Hk, D] at slot_mapping (k itself is left as it was)."""
    _fn("rope_store_kv", q.device)(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                   slot_mapping, q_norm, k_norm, eps, head_dim, is_neox)


def rope_store_kv_fp8(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                      slot_mapping: torch.Tensor, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float, head_dim: int,
                      is_neox: bool) -> None:
    """rope_store_kv into the FP8 pool: k (normed and rotated, rounded to q's dtype as
    rope_store_kv stores it) and v are quantized as store_kv_fp8 quantizes them, into k_cache,
    v_cache uint8 [S, Hk, D] (e4m3fn codes) and k_scale, v_scale float32 [S, Hk]."""
    _fn("rope_store_kv_fp8", q.device)(positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                       k_scale, v_scale, slot_mapping, q_norm, k_norm, eps,
                                       head_dim, is_neox)


def scaled_gemv(out: torch.Tensor, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                row_scale: torch.Tensor, fmt: int, block_n: int, block_k: int) -> None:
    """GPU decode product over a scaled weight W [N, K] (models/quant/scaled.py), T <= 8:
    out[T, N] = x[T, K] @ W.T with W[n, k] = value(data)[n, k] * scales[n // block_n,
    k // block_k] * row_scale[n]. fmt 0 (FP8): data uint8 [N, K] e4m3 bytes, scales float32
    [ceil(N/bn), ceil(K/bk)]; fmt 1 (NVFP4): data uint8 [N, K/2] (low nibble first), scales
    uint8 e4m3 bytes [N, K/16] (the block arguments are ignored). row_scale float32 [N];
    x, out bf16/f16/f32; K a multiple of 16."""
    _fn("scaled_gemv", x.device)(out, x, data, scales, row_scale, fmt, block_n, block_k)


def fp8_gemv(out: torch.Tensor, x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
             row_scale: torch.Tensor, block_n: int, block_k: int, rows: int = 0) -> None:
    """GPU decode product (T <= 8) as scaled_gemv for FP8 (fmt 0) with x, out bf16 or f16 and
    block_k a power of two >= 16 or >= K: 16-byte coalesced loads, `rows` weight rows per warp
    (1, 2 or 4; 0 picks by T)."""
    _fn("fp8_gemv", x.device)(out, x, data, scales, row_scale, block_n, block_k, rows)


def fp8_gemv_fused(out: torch.Tensor, x: torch.Tensor, data: torch.Tensor,
                   scales: torch.Tensor, row_scale: torch.Tensor, block_n: int, block_k: int,
                   bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, mode: int = 0, rows: int = 0, pdl: bool = False) -> None:
    """fp8_gemv with the fused decode step's prologue and epilogues: xn = rms_norm(x) *
    norm_weight when given (else x); mode 0: out = xn @ W.T (+ bias); 1: out (the residual) +=
    xn @ W.T; 2: out = silu(g) * u for [g | u] = xn @ W.T, W [2I, K]. pdl: launch as a
    programmatic dependent where the GPU has it."""
    _fn("fp8_gemv_fused", x.device)(out, x, data, scales, row_scale, block_n, block_k, bias,
                                    norm_weight, eps, mode, rows, pdl)


def scaled_dequantize(out: torch.Tensor, data: torch.Tensor, scales: torch.Tensor,
                      row_scale: torch.Tensor, fmt: int, block_n: int, block_k: int) -> None:
    """out[N, K] (bf16/f16/f32, contiguous) = the scaled weight of ``scaled_gemv``."""
    _fn("scaled_dequantize", data.device)(out, data, scales, row_scale, fmt, block_n, block_k)


def moe_experts_scaled(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor,
                       w13_scales: torch.Tensor, w13_rows: torch.Tensor, w2: torch.Tensor,
                       w2_scales: torch.Tensor, w2_rows: torch.Tensor, fmt: int, bn13: int,
                       bk13: int, bn2: int, bk2: int, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, expert_map: torch.Tensor,
                       act: torch.Tensor) -> None:
    """``moe_experts`` on the GPU over scaled experts, for decode batches: w13 uint8
    [S, 2I, H] (FP8) or [S, 2I, H/2] (NVFP4) and w2 [S, H, I] / [S, H, I/2], each with its
    scales and row scales laid out per slot as ``scaled_gemv``'s (the block arguments for FP8
    grids); act: contiguous scratch of x's dtype holding at least T*K*I values. H and I
    multiples of 16; no host sync, capturable in a CUDA graph."""
    _fn("moe_experts_scaled", x.device)(
        out, x, w13, w13_scales, w13_rows, w2, w2_scales, w2_rows, fmt, bn13, bk13, bn2, bk2,
        topk_ids, topk_weights, expert_map, act)


def moe_experts_gguf(out: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     qtype13: int, qtype2: int, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, expert_map: torch.Tensor,
                     workspace: torch.Tensor) -> None:
    """``moe_experts`` on the GPU over GGUF blocks kept in VRAM: out/x bf16 [T, H]; w13 uint8
    [S, 2I, row_bytes] (gate rows, then up rows) and w2 uint8 [S, H, row_bytes] hold one weight
    row per row in GGML type qtype13 / qtype2 (each any of Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7,
    Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14); workspace as moe_experts with itemsize 2. No host sync,
    no allocation."""
    _fn("moe_experts_gguf", x.device)(
        out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights, expert_map, workspace)


def vision_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, num_heads: int, scale: float) -> None:
    """Non-causal attention within segments: token t attends to every token of its segment
    [cu_seqlens[s], cu_seqlens[s+1]). out, q, k, v [T, H*D] (rows may be strided), D a multiple
    of 8 up to 128 on the GPU; cu_seqlens int32 [S+1] from 0 to T."""
    _fn("vision_attention", q.device)(out, q, k, v, cu_seqlens, num_heads, scale)


def moe_decode_gate_up(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_ids: torch.Tensor, expert_map: torch.Tensor,
                       workspace: torch.Tensor, shared_w13: torch.Tensor | None = None,
                       shared_act: torch.Tensor | None = None,
                       shared_gate_weight: torch.Tensor | None = None,
                       shared_gate: torch.Tensor | None = None, variant: int = 0) -> None:
    """GPU MoE decode, T <= 8 tokens, bf16/f16: the SwiGLU activations of every routed pair
    (token t, k) into the first T*K*I elements of `workspace` (bytes, 16-byte aligned), laid
    out [T*K, I] by pair t*K + k, reading expert slot expert_map[topk_ids[t, k]] of w13 [S, 2I, H]
    (w2 [S, H, I] only for its shape); with the shared expert, shared_act [T, Is] =
    SwiGLU(x @ shared_w13[2Is, H].T) and shared_gate [T, 1] = x @ shared_gate_weight[1, H].T.
    `variant` (0..6) picks a launch shape, same results up to the f32 summation order
    (moe_decode_kernels.cuh kVariants)."""
    _fn("moe_decode_gate_up", x.device)(x, w13, w2, topk_ids, expert_map, workspace, shared_w13,
                                        shared_act, shared_gate_weight, shared_gate, variant)


def moe_decode_down(out: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor,
                    workspace: torch.Tensor, shared_w2: torch.Tensor | None = None,
                    shared_act: torch.Tensor | None = None,
                    shared_gate: torch.Tensor | None = None, accumulate: bool = False,
                    variant: int = 0) -> None:
    """After moe_decode_gate_up: y[t] = sum_k topk_weights[t, k] * act[t*K + k] @ w2[slot].T
    (+ sigmoid(shared_gate[t]) * shared_act[t] @ shared_w2[H, Is].T), each rounded as the
    unfused chain; out = y, or out += y when `accumulate` (the residual stream); `variant` as
    moe_decode_gate_up's (0..6)."""
    _fn("moe_decode_down", out.device)(out, w13, w2, topk_ids, topk_weights, expert_map,
                                       workspace, shared_w2, shared_act, shared_gate, accumulate,
                                       variant)
