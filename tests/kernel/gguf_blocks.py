"""Random but valid GGUF blocks of any type the CPU kernels read, and their float values by the
`gguf` package's own numpy dequantizer (the independent reference)."""

from __future__ import annotations

import gguf
import numpy as np

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
LEGACY = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0)
KQUANTS = (Q4_K, Q5_K, Q6_K)

# byte offsets of each block's f16 fields, and the largest |integer factor| a weight gets
# from them (scale x quant), so every weight lands near [-1, 1]
_HALVES = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,),
           Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
_RANGE = {Q4_0: 8, Q4_1: 15, Q5_0: 16, Q5_1: 31, Q8_0: 127,
          Q4_K: 63 * 15, Q5_K: 63 * 31, Q6_K: 128 * 32}


def block_bytes(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block."""
    size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return size, nbytes


def random_rows(rows: int, k: int, qtype: int, seed: int, lead: tuple[int, ...] = (),
                half_scale: float = 1.0) -> np.ndarray:
    """uint8 [*lead, rows, row_bytes]: random quant bytes and scales, finite f16 d (and min);
    `half_scale` multiplies every f16 value (2**-20 makes them subnormal halves)."""
    size, nbytes = block_bytes(qtype)
    assert k % size == 0, (k, size)
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(*lead, rows, k // size, nbytes), dtype=np.uint8)
    for at in _HALVES[qtype]:
        half = g.uniform(0.25, 1.0, size=blocks.shape[:-1]) / _RANGE[qtype] * half_scale
        half *= g.choice([-1.0, 1.0], size=half.shape)
        blocks[..., at:at + 2] = half.astype(np.float16)[..., None].view(np.uint8)
    return np.ascontiguousarray(blocks.reshape(*lead, rows, -1))


def dequantize(rows: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [..., k] by gguf.quants.dequantize."""
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype)).astype(np.float32)
