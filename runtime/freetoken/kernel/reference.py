"""Plain-torch references for every op in ``ops``: same signatures, computed in float32.

The kernel tests compare the compiled kernels with these; they are never on a hot path.
"""

from __future__ import annotations

import numpy as np
import torch

Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK = 32
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def rms_norm(out, x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    out.copy_(y.to(out.dtype))


def fused_add_rms_norm(x, residual, weight, eps):
    residual.copy_((residual.float() + x.float()).to(residual.dtype))
    rms_norm(x, residual, weight, eps)


def rms_norm_gated(out, x, z, weight, eps):
    t, width, g = x.shape[0], x.shape[1], weight.shape[0]
    groups = x.reshape(t * width // g, g)
    normed = torch.empty_like(groups)
    rms_norm(normed, groups, weight, eps)
    gate = torch.nn.functional.silu(z.reshape(t * width // g, g).float())
    out.copy_((normed.float() * gate).to(out.dtype).reshape(t, width))


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim, is_neox):
    rot = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, rot/2]
    for t in (q, k):
        heads = t.view(t.shape[0], -1, head_dim)
        part = heads[..., :rot].float()
        if is_neox:
            x1, x2 = part[..., : rot // 2], part[..., rot // 2:]
            c, s = cos[:, None, :], sin[:, None, :]
            rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
            c, s = cos[:, None, :], sin[:, None, :]
            rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
        heads[..., :rot] = rotated.to(t.dtype)


def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    xf = x.float()
    out.copy_((torch.nn.functional.silu(xf[..., :d]) * xf[..., d:]).to(out.dtype))


def gelu_tanh_and_mul(out, x):
    d = x.shape[-1] // 2
    xf = x.float()
    gate = torch.nn.functional.gelu(xf[..., :d], approximate="tanh")
    out.copy_((gate * xf[..., d:]).to(out.dtype))


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


E4M3_MAX = 448.0


def quantize_fp8_rows(x):
    """uint8 e4m3fn codes and float32 scales [...] of rows x [..., D], as store_kv_fp8 writes
    them: scale = max |x| / 448 (1 for an all-zero row), code = e4m3(x / scale), rounded to
    nearest even (torch's float8 conversion)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (xf / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


def dequantize_fp8_rows(codes, scale):
    """float32 values of an FP8 pool: codes uint8 [..., D] (e4m3fn) times scale [...]."""
    return codes.view(torch.float8_e4m3fn).float() * scale[..., None]


def store_kv_fp8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, scale = quantize_fp8_rows(x[keep])
        cache[slots] = codes
        scales[slots] = scale


def embedding(out, ids, table):
    out.copy_(table[ids].to(out.dtype))


def paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                    block_size, scale, sliding_window=0):
    hq, hk = q.shape[1], k_cache.shape[1]
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n_ctx, n_new = int(seq_lens[b]), end - start
        if n_new == 0:
            continue
        pos = torch.arange(n_ctx)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache[slots].float().repeat_interleave(hq // hk, dim=1)   # [n_ctx, Hq, D]
        vals = v_cache[slots].float().repeat_interleave(hq // hk, dim=1)
        qb = q[start:end].float()                                            # [n_new, Hq, D]
        scores = torch.einsum("thd,shd->hts", qb, keys) * scale
        q_pos = torch.arange(n_ctx - n_new, n_ctx)[:, None]
        mask = pos[None, :] > q_pos
        if sliding_window > 0:
            mask |= pos[None, :] <= q_pos - sliding_window
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = scores.softmax(-1)
        out[start:end] = torch.einsum("hts,shd->thd", probs, vals).to(out.dtype)


def paged_attention_fp8(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                        query_start_loc, block_size, scale, sliding_window=0, workspace=None):
    """paged_attention over the FP8 pool's values, dequantized to float32."""
    paged_attention(out, q, dequantize_fp8_rows(k_cache, k_scale),
                    dequantize_fp8_rows(v_cache, v_scale), block_tables, seq_lens,
                    query_start_loc, block_size, scale, sliding_window)


def unpadded(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF rows without the padding the GPU keeps after their blocks (weights.gpu_rows)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    data = qweight.shape[-1] // size * size
    return qweight if data == qweight.shape[-1] else qweight[..., :data].contiguous()


def dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] GGUF blocks (rows padded or not) -> float32 [N, K]."""
    qweight = unpadded(qweight, qtype)
    n = qweight.shape[0]
    if qtype not in BLOCK_BYTES:   # Q5_0/Q5_1 and the K-quants: the gguf package's numpy path
        from gguf import GGMLQuantizationType, quants

        vals = quants.dequantize(qweight.numpy(), GGMLQuantizationType(qtype))
        return torch.from_numpy(np.ascontiguousarray(vals, dtype=np.float32).reshape(n, -1))
    blocks = qweight.reshape(n, -1, BLOCK_BYTES[qtype]).numpy()
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)       # [N, nb, 1]
    if qtype == Q8_0:
        q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
        vals = d * q
    else:
        qs = blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]
        lo, hi = (qs & 0x0F).astype(np.float32), (qs >> 4).astype(np.float32)
        q = np.concatenate((lo, hi), axis=-1)                               # [N, nb, 32]
        if qtype == Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
            vals = d * q + m
        else:
            vals = d * (q - 8.0)
    return torch.from_numpy(vals.reshape(n, -1).astype(np.float32))


def gguf_dequantize(out, qweight, qtype):
    """out[N, K] = the float values of GGUF rows qweight [N, row_bytes] (padded or not)."""
    out.copy_(dequantize(qweight.cpu(), qtype).to(out.device, out.dtype))


def quantize(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float [N, K] -> uint8 [N, row_bytes] GGUF blocks (round to nearest, as ggml does)."""
    w = weight.float().reshape(weight.shape[0], -1, BLOCK).numpy()
    n, nb = w.shape[:2]
    if qtype == Q8_0:
        amax = np.abs(w).max(-1, keepdims=True)
        d = amax / 127.0
        q = np.round(np.divide(w, d, out=np.zeros_like(w), where=d > 0)).astype(np.int8)
        parts = [d.astype(np.float16).view(np.uint8), q.view(np.uint8)]
    elif qtype == Q4_1:
        lo, hi = w.min(-1, keepdims=True), w.max(-1, keepdims=True)
        d = (hi - lo) / 15.0
        q = np.clip(np.round(np.divide(w - lo, d, out=np.zeros_like(w), where=d > 0)), 0, 15)
        q = q.astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8), packed]
    elif qtype == Q4_0:
        idx = np.abs(w).argmax(-1)[..., None]
        mx = np.take_along_axis(w, idx, -1)
        d = mx / -8.0
        q = np.clip(np.round(np.divide(w, d, out=np.zeros_like(w), where=d != 0) + 8), 0, 15)
        q = q.astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [d.astype(np.float16).view(np.uint8), packed]
    else:
        raise ValueError(f"unsupported GGML type {qtype}")
    blocks = np.concatenate(parts, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(blocks.reshape(n, nb * BLOCK_BYTES[qtype])))


def quant_matmul(out, x, qweight, qtype):
    out.copy_(x.float() @ dequantize(qweight, qtype).T)


def dequantize_rows(out, ids, qweight, qtype):
    out.copy_(dequantize(qweight[ids], qtype))


# ---- MoE: routing and routed experts (numpy arrays on the CPU, torch tensors on a GPU) -------

def _host(array) -> np.ndarray:
    """A numpy view of a kernel argument (numpy array, tvm_ffi.Tensor or CPU torch tensor)."""
    if isinstance(array, torch.Tensor):
        return array.numpy()
    return np.from_dlpack(array)


def moe_topk_softmax(topk_weights, topk_ids, logits, renormalize):
    """softmax over experts in f32, the K largest in descending order (ties: lower id first),
    optionally divided by their sum."""
    k = topk_ids.shape[1]
    if isinstance(logits, torch.Tensor):
        probs = logits.float().softmax(-1)
        values, ids = probs.sort(dim=-1, descending=True, stable=True)
        values, ids = values[:, :k], ids[:, :k]
        if renormalize:
            values = values / values.sum(-1, keepdim=True)
        topk_weights.copy_(values)
        topk_ids.copy_(ids.to(torch.int32))
        return
    x = _host(logits).astype(np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    probs = e / e.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    values = np.take_along_axis(probs, ids, -1)
    if renormalize:
        values = values / values.sum(-1, keepdims=True)
    _host(topk_weights)[...] = values
    _host(topk_ids)[...] = ids.astype(np.int32)


def _token_chunk(k: int, expert_values: int) -> int:
    """Tokens per step so the gathered f32 expert weights (w13 and w2: 3/2 of w13's values
    per routed expert) stay near 256 MB."""
    per_token = k * (expert_values + expert_values // 2) * 4
    return max(1, (256 << 20) // max(per_token, 1))


def _experts_rows(x, w13, w2, weights, lib):
    """sum_k weights[t,k] * w2[s] @ (silu(gate) * up) for one chunk of tokens, in f32.
    x [t, H] f32; w13 [t, K, 2I, H] and w2 [t, K, H, I] already gathered per (token, k)."""
    i = w13.shape[2] // 2
    h13 = lib.einsum("tkih,th->tki", w13, x)
    gate, up = h13[..., :i], h13[..., i:]
    act = gate / (1.0 + lib.exp(-gate)) * up
    down = lib.einsum("tkhi,tki->tkh", w2, act)
    return (down * weights[..., None]).sum(1)


def moe_experts(out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace):
    """out[t] = sum_k w[t,k] * w2[s] @ (silu(w13[s,:I] @ x[t]) * (w13[s,I:] @ x[t])),
    s = expert_map[topk_ids[t,k]]; a pair whose expert has no slot (s < 0) adds nothing, as in
    the kernels; f32 accumulation; the workspace is not needed here."""
    torch_mode = isinstance(x, torch.Tensor)
    lib = torch if torch_mode else np
    xs = x.float() if torch_mode else _host(x).astype(np.float32)
    w13a, w2a = (w13, w2) if torch_mode else (_host(w13), _host(w2))
    ids, tw = (topk_ids, topk_weights) if torch_mode else (_host(topk_ids), _host(topk_weights))
    emap = expert_map if torch_mode else _host(expert_map)
    slots = emap[ids.long() if torch_mode else ids]
    if (slots < 0).any():   # unmapped: weight 0, any slot's rows (multiplied by that 0)
        tw = lib.where(slots < 0, 0 * tw, tw)
        slots = lib.where(slots < 0, 0 * slots, slots)
    tokens = xs.shape[0]
    step = _token_chunk(ids.shape[1], w13a.shape[1] * w13a.shape[2])
    results = []
    for start in range(0, tokens, step):
        s = slots[start:start + step]
        g13, g2 = w13a[s], w2a[s]
        if torch_mode:
            g13, g2 = g13.float(), g2.float()
        else:
            g13, g2 = g13.astype(np.float32), g2.astype(np.float32)
        results.append(_experts_rows(xs[start:start + step], g13, g2, tw[start:start + step],
                                     lib))
    value = lib.cat(results) if torch_mode else np.concatenate(results)
    if torch_mode:
        out.copy_(value.to(out.dtype))
    else:
        _host(out)[...] = value


_FLOAT_TYPES = {0: np.float32, 1: np.float16}   # GGML F32, F16


def dequantize_rows_np(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """uint8 [..., row_bytes] GGUF rows (any block type dequantize reads, F16, F32) -> float32
    [..., K]."""
    if qtype in _FLOAT_TYPES:
        return np.ascontiguousarray(blocks).view(_FLOAT_TYPES[qtype]).astype(np.float32)
    lead = blocks.shape[:-1]
    flat = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1, blocks.shape[-1]))
    return dequantize(flat, qtype).numpy().reshape(*lead, -1)


def moe_experts_quant(out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights, expert_map,
                      workspace):
    """moe_experts over GGUF-block expert weights (CPU): the rows of the slots this step
    routes to are dequantized exactly, then computed as moe_experts does."""
    emap = _host(expert_map)
    used = np.unique(emap[_host(topk_ids)])
    w13d = dequantize_rows_np(_host(w13)[used], qtype13)
    w2d = dequantize_rows_np(_host(w2)[used], qtype2)
    compact = np.searchsorted(used, emap).clip(0, len(used) - 1).astype(np.int32)
    moe_experts(out, x, w13d, w2d, topk_ids, topk_weights, compact, workspace)


def _normed(x, norm_weight, eps):
    if norm_weight is None:
        return x
    xn = torch.empty_like(x)
    rms_norm(xn, x, norm_weight, eps)
    return xn


def decode_gemv(out, x, weight, bias, norm_weight, eps, group, variant=0):
    """The unfused chain: [rms_norm], mm (+ bias), rounded once to out's dtype."""
    y = _normed(x, norm_weight, eps).float() @ weight.float().T
    out.copy_((y + bias.float() if bias is not None else y).to(out.dtype))


def decode_gemv_add(residual, x, weight, group, variant=0):
    prod = (x.float() @ weight.float().T).to(residual.dtype)
    residual.copy_((residual.float() + prod.float()).to(residual.dtype))


def decode_gemv_swiglu(out, x, gate_up, norm_weight, eps, group, variant=0):
    silu_and_mul(out, (_normed(x, norm_weight, eps).float() @ gate_up.float().T).to(out.dtype))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """gguf_gemv_q8's int8 activations, dequantized (float32, x's shape): per 32 values of a
    row, d = amax / 127 and q = rint(x * 127 / amax) (round half to even), in float32."""
    v = x.float().reshape(x.shape[0], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(v * inv) * (amax / 127.0)).reshape(x.shape)


def gguf_gemv_q8(out, x, qweight, qtype, bias=None, norm_weight=None, eps=0.0, mode=0, rows=0,
                 pdl=False):
    """The unfused chain on int8 activations: [rms_norm], quantize, mm over the dequantized
    blocks, then the mode's epilogue (0: + bias, 1: residual add, 2: SwiGLU)."""
    xq = quantize_activations(_normed(x, norm_weight, eps))
    _epilogue(out, xq @ dequantize(qweight.cpu(), qtype).T.to(xq.device), bias, mode)


def _expert_slots(topk_ids, expert_map):
    """Slot per routed pair (flat, t * K + k), -1 where the id is out of range or unmapped."""
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < expert_map.shape[0])
    slots = torch.where(valid, expert_map[ids.clamp(0, expert_map.shape[0] - 1)].long(),
                        torch.full_like(ids, -1))
    return slots


def moe_q8_gate_up(act, x, w13, qtype, topk_ids, expert_map, rows=0, pdl=False):
    """act[p] = silu(gate) * up of pair p's expert on int8 activations of x (zeros for a pair
    without a slot), rounded where the unfused chain stores."""
    k = topk_ids.shape[1]
    xq = quantize_activations(x)
    for p, slot in enumerate(_expert_slots(topk_ids, expert_map).tolist()):
        if slot < 0:
            act[p].zero_()
            continue
        gu = xq[p // k] @ dequantize(w13[slot].cpu(), qtype).T.to(xq.device)
        silu_and_mul(act[p:p + 1], gu[None].to(act.dtype))


def moe_q8_down(out, act, w2, qtype, topk_ids, topk_weights, expert_map, accumulate=False,
                rows=0, pdl=False):
    """out[t] (+)= sum_k w[t, k] * down_s(int8 activations of act[t * K + k]), the routed sum
    rounded once to out's dtype (then the residual add, rounded again)."""
    k = topk_ids.shape[1]
    aq = quantize_activations(act)
    y = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for p, slot in enumerate(_expert_slots(topk_ids, expert_map).tolist()):
        if slot >= 0:
            w = topk_weights.reshape(-1)[p].float()
            y[p // k] += w * (aq[p] @ dequantize(w2[slot].cpu(), qtype).T.to(aq.device))
    if accumulate:
        out.copy_((out.float() + y.to(out.dtype).float()).to(out.dtype))
    else:
        out.copy_(y.to(out.dtype))


def _epilogue(out, y, bias, mode):
    """The fused decode GEMVs' epilogues over the float32 product y, rounded where the unfused
    chain stores: 0 store (+ bias), 1 residual add, 2 SwiGLU of [gate | up]."""
    if mode == 0:
        out.copy_((y + bias.float() if bias is not None else y).to(out.dtype))
    elif mode == 1:
        out.copy_((out.float() + y.to(out.dtype).float()).to(out.dtype))
    else:
        silu_and_mul(out, y.to(out.dtype))


def _rope_qk(positions, q, k, cos_sin_cache, q_norm, k_norm, eps, head_dim, is_neox):
    """[per-head rms_norm of q and k], rotary_embedding: q in place; the new k [T, Hk, D]."""
    t = q.shape[0]
    qh, kh = q.reshape(t, -1, head_dim).clone(), k.reshape(t, -1, head_dim).clone()
    if q_norm is not None:
        rms_norm(qh, qh.clone(), q_norm, eps)
        rms_norm(kh, kh.clone(), k_norm, eps)
    qf, kf = qh.view(t, -1), kh.view(t, -1)
    rotary_embedding(positions, qf, kf, cos_sin_cache, head_dim, is_neox)
    q.copy_(qf)
    return kh


def rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_norm,
                  k_norm, eps, head_dim, is_neox):
    """The unfused chain: [per-head rms_norm of q and k], rotary_embedding, store_kv; q is
    written in place, k and v are left as they are."""
    kh = _rope_qk(positions, q, k, cos_sin_cache, q_norm, k_norm, eps, head_dim, is_neox)
    store_kv(kh, v.reshape(q.shape[0], -1, head_dim), k_cache, v_cache, slot_mapping)


def rope_store_kv_fp8(positions, q, k, v, cos_sin_cache, k_cache, v_cache, k_scale, v_scale,
                      slot_mapping, q_norm, k_norm, eps, head_dim, is_neox):
    """rope_store_kv's chain with store_kv_fp8 as its store."""
    kh = _rope_qk(positions, q, k, cos_sin_cache, q_norm, k_norm, eps, head_dim, is_neox)
    store_kv_fp8(kh, v.reshape(q.shape[0], -1, head_dim), k_cache, v_cache, k_scale, v_scale,
                 slot_mapping)


def _scaled_values(data, scales, row_scale, fmt, block_n, block_k):
    """float32 [N, K] of a scaled weight as scaled_gemv reads it (fmt 0 FP8, 1 NVFP4)."""
    from freetoken.models.quant import scaled

    if fmt == 0:
        n, k = data.shape
        weight = scaled.ScaledWeight(scaled.FP8, data.view(torch.float8_e4m3fn), scales, (n, k),
                                     (block_n, min(block_k, k)), row_scale)
    else:
        n, k = data.shape[0], 2 * data.shape[1]
        weight = scaled.ScaledWeight(scaled.NVFP4, data, scales.view(torch.float8_e4m3fn),
                                     (n, k), (1, 16), row_scale)
    return scaled.dequantize(weight)


def scaled_gemv(out, x, data, scales, row_scale, fmt, block_n, block_k):
    w = _scaled_values(data, scales, row_scale, fmt, block_n, block_k)
    out.copy_((x.float() @ w.T).to(out.dtype))


def fp8_gemv_fused(out, x, data, scales, row_scale, block_n, block_k, bias=None,
                   norm_weight=None, eps=0.0, mode=0, rows=0, pdl=False):
    """The unfused chain: [rms_norm], mm over the dequantized FP8 weight, then the mode's
    epilogue (0: + bias, 1: residual add, 2: SwiGLU), each rounded where that chain stores."""
    w = _scaled_values(data, scales, row_scale, 0, block_n, block_k)
    _epilogue(out, _normed(x, norm_weight, eps).float() @ w.T.to(x.device), bias, mode)


def scaled_dequantize(out, data, scales, row_scale, fmt, block_n, block_k):
    out.copy_(_scaled_values(data, scales, row_scale, fmt, block_n, block_k).to(out.dtype))


def moe_experts_scaled(out, x, w13, w13_scales, w13_rows, w2, w2_scales, w2_rows, fmt, bn13,
                       bk13, bn2, bk2, topk_ids, topk_weights, expert_map, act):
    """moe_experts over scaled experts (the slots dequantized one by one, then moe_experts)."""
    w13f = torch.stack([_scaled_values(w13[s], w13_scales[s], w13_rows[s], fmt, bn13, bk13)
                        for s in range(w13.shape[0])])
    w2f = torch.stack([_scaled_values(w2[s], w2_scales[s], w2_rows[s], fmt, bn2, bk2)
                       for s in range(w2.shape[0])])
    moe_experts(out, x, w13f, w2f, topk_ids, topk_weights, expert_map, None)


def vision_attention(out, q, k, v, cu_seqlens, num_heads, scale):
    """Each segment [cu[s], cu[s+1]) attends to itself only, without a causal mask."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    tokens = q.shape[0]
    qf, kf, vf = (t.float().reshape(tokens, num_heads, -1).transpose(0, 1) for t in (q, k, v))
    for begin, end in zip(cu[:-1], cu[1:]):
        if end == begin:
            continue
        scores = qf[:, begin:end] @ kf[:, begin:end].transpose(1, 2) * scale
        part = torch.softmax(scores, dim=-1) @ vf[:, begin:end]      # [H, n, D]
        out[begin:end] = part.transpose(0, 1).reshape(end - begin, -1).to(out.dtype)
