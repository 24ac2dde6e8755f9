"""Random valid GGUF blocks of every type the GPU reads, and their float values by gguf's own
numpy dequantizer (the independent reference). gguf's numpy quantizer has no K-quants, so
blocks are random bytes with their f16 scale fields set to finite values of a chosen size."""

from __future__ import annotations

import numpy as np

# GGML type id -> (weights, bytes) per block, and the byte offsets of its f16 scale fields
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
          13: (256, 176), 14: (256, 210)}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
         14: "Q6_K"}
# offset 2 is a signed min (Q4_1, Q5_1 m; K-quant dmin)
_SCALES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
# Scale sizes that give weights of about 0.05: |q| up to 8 (Q4_0), 16 (Q4_1, Q5_0), 32 (Q5_1),
# 128 (Q8_0), 63 * 31 (Q4_K/Q5_K scale times value) and 128 * 32 (Q6_K).
_SCALE_SIZE = {2: 6e-3, 3: 3e-3, 6: 3e-3, 7: 1.5e-3, 8: 4e-4, 12: 3e-5, 13: 3e-5, 14: 1.2e-5}


def row_bytes(qtype: int, cols: int) -> int:
    weights, nbytes = BLOCKS[qtype]
    assert cols % weights == 0, f"{NAMES[qtype]} rows hold multiples of {weights} weights"
    return cols // weights * nbytes


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator,
                  size: float = 1.0, centered: bool = False) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks (finite scales, about 0.05 * size in magnitude).

    Random bytes make the types with a min or offset (Q4_1, Q5_1, Q4_K, Q5_K) far from
    zero-mean: every weight of a sub-block shares one random offset, so a product sums it
    coherently. That is right for the kernels' tests (every bit pattern) but gives a model
    whose logits swing with the smallest rounding of its activations. `centered` blocks are
    zero-mean, as a quantizer writes them from real weights: the offset is minus the middle of
    the quants' range times the scale (K-quants: 6-bit mins of 7.5 / 15.5 times their scales,
    dmin = d)."""
    weights, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for field in _SCALES[qtype]:
        sign = rng.choice([-1.0, 1.0], size=raw.shape[:2]) if field == 2 else 1.0
        scale = (sign * size * _SCALE_SIZE[qtype] * rng.uniform(0.5, 1.5, size=raw.shape[:2]))
        raw[:, :, field:field + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    if centered:
        _center(raw, qtype, size, rng)
    return raw.reshape(rows, -1)


# the middle of the quants' range: Q4_1 0..15, Q5_1 0..31, Q4_K 0..15, Q5_K 0..31
_MIDDLE = {3: 7.5, 7: 15.5, 12: 7.5, 13: 15.5}


def _center(raw: np.ndarray, qtype: int, size: float, rng: np.random.Generator) -> None:
    """Rewrites the offsets of blocks [rows, blocks, bytes] in place (random_blocks' doc)."""
    if qtype not in _MIDDLE:
        return
    mid = _MIDDLE[qtype]
    if qtype in (3, 7):          # m = -mid * d
        d = raw[:, :, 0:2].copy().view(np.float16).astype(np.float32)
        raw[:, :, 2:4] = (-mid * d).astype(np.float16).view(np.uint8)
        return
    # K-quants: sub-block scales sc <= 63 / mid, mins rint(mid * sc), dmin = d > 0
    sc = rng.integers(1, int(63 // mid) + 1, size=raw.shape[:2] + (8,))
    mn = np.rint(sc * mid).astype(np.int64)
    raw[:, :, 4:16] = _pack_scales_mins(sc, mn)
    d = (size * 5e-4 * rng.uniform(0.5, 1.5, size=raw.shape[:2])).astype(np.float16)
    raw[:, :, 0:2] = d[..., None].view(np.uint8)
    raw[:, :, 2:4] = d[..., None].view(np.uint8)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> their 12 bytes in llama.cpp's K-quant layout:
    bytes 0-3 and 4-7 hold scales / mins 0-3 (low 6 bits) and the top 2 bits of 4-7; bytes
    8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    q = np.zeros(sc.shape[:-1] + (12,), dtype=np.uint8)
    for s in range(4):
        q[..., s] = (sc[..., s] & 63) | ((sc[..., s + 4] >> 4) << 6)
        q[..., s + 4] = (mn[..., s] & 63) | ((mn[..., s + 4] >> 4) << 6)
        q[..., s + 8] = (sc[..., s + 4] & 15) | ((mn[..., s + 4] & 15) << 4)
    return q


def dequantize(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [rows, cols] by gguf.quants.dequantize; rows padded after their blocks (as the
    GPU keeps them) are read without the padding."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1]
    blocks = np.ascontiguousarray(blocks[..., :blocks.shape[-1] // size * size])
    return quants.dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32)
