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


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    k_cache[slot_mapping[keep]] = k[keep].to(k_cache.dtype)
    v_cache[slot_mapping[keep]] = v[keep].to(v_cache.dtype)


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


def dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 [N, row_bytes] GGUF blocks -> float32 [N, K]."""
    n = qweight.shape[0]
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
