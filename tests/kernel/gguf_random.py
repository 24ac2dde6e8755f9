"""Random valid GGUF blocks of every type the GPU reads, and their float values by gguf's own
numpy dequantizer (the independent reference). gguf's numpy quantizer has no K-quants, so
blocks are random bytes with their f16 scale fields set to finite values of a chosen size."""

from __future__ import annotations

import numpy as np

# GGML type id -> (weights, bytes) per block, and the byte offsets of its f16 scale fields
BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_SCALES = {2: (0,), 3: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
# Scale sizes that give weights of about 0.05: |q| up to 8 (Q4_0), 16 (Q4_1), 128 (Q8_0),
# 63 * 31 (Q4_K/Q5_K scale times value) and 128 * 32 (Q6_K).
_SCALE_SIZE = {2: 6e-3, 3: 3e-3, 8: 4e-4, 12: 3e-5, 13: 3e-5, 14: 1.2e-5}


def row_bytes(qtype: int, cols: int) -> int:
    weights, nbytes = BLOCKS[qtype]
    assert cols % weights == 0, f"{NAMES[qtype]} rows hold multiples of {weights} weights"
    return cols // weights * nbytes


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator,
                  size: float = 1.0) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks (finite scales, about 0.05 * size in magnitude)."""
    weights, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    for field in _SCALES[qtype]:
        sign = rng.choice([-1.0, 1.0], size=raw.shape[:2]) if field == 2 else 1.0
        scale = (sign * size * _SCALE_SIZE[qtype] * rng.uniform(0.5, 1.5, size=raw.shape[:2]))
        raw[:, :, field:field + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def dequantize(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """float32 [rows, cols] by gguf.quants.dequantize."""
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(blocks, GGMLQuantizationType(qtype)).astype(np.float32)
