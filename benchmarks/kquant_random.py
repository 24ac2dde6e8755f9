"""Random GGUF blocks that look like quantized trained weights: every field valid and the values
zero-mean with a chosen standard deviation, so a deep random model keeps bounded activations.

Per type (llama.cpp's block layouts, ggml-common.h; value = what dequantization gives):

- Q4_K (144 B: d, dmin, 12 bytes of 6-bit scales and mins, 128 nibble bytes): value
  = d * sc * q - dmin * m with q in 0..15. With dmin = d and m = 7.5 * sc (rounded up or down at
  random) each sub-block is centred on zero.
- Q5_K (176 B: d, dmin, scales, 32 high-bit bytes, 128 nibble bytes): q in 0..31, m = 15.5 * sc.
- Q6_K (210 B: 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d): value
  = d * sc * (q - 32); scales of random sign cancel the -0.5 mean of q - 32.
- Q8_0 (34 B: d, 32 int8), Q5_0 (22 B: d, 4 high-bit bytes, 16 nibble bytes; value
  = d * (q - 16)) with d of random sign; Q5_1 (24 B: d, m, ...; value = d * q + m) with m = -15.5 d.

The quantized levels themselves are uniform random bits. Generation is split into chunks with
seeds spawned from one SeedSequence, filled by a thread pool (numpy releases the GIL there): the
bytes depend on the seed only, not on the number of threads.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

F32, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 0, 6, 7, 8, 12, 13, 14
NAMES = {F32: "F32", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K",
         Q6_K: "Q6_K"}
# type -> (weights per block, bytes per block)
BLOCKS = {Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176),
          Q6_K: (256, 210)}
# type -> (levels of q, range of the integer sub-block scale |sc| (inclusive)); 1 = no scales
_LEVELS = {Q5_0: (32, (1, 1)), Q5_1: (32, (1, 1)), Q8_0: (256, (1, 1)), Q4_K: (16, (1, 8)),
           Q5_K: (32, (1, 4)), Q6_K: (64, (1, 16))}
_CHUNK_WORDS = 1 << 22          # 32 MiB of random bits per chunk


def row_bytes(qtype: int, cols: int) -> int:
    weights, nbytes = BLOCKS[qtype]
    if cols % weights:
        raise ValueError(f"{NAMES[qtype]} rows hold multiples of {weights} weights, got {cols}")
    return cols // weights * nbytes


def base_scale(qtype: int, sigma: float) -> float:
    """The block scale d (before its uniform 0.5-1.5 jitter) whose values have std `sigma`:
    std = d * std(q) * rms(sc) * rms(jitter), q uniform over its levels."""
    levels, (lo, hi) = _LEVELS[qtype]
    q_std = np.sqrt((levels ** 2 - 1) / 12.0)
    sc_rms = np.sqrt(np.mean(np.arange(lo, hi + 1, dtype=np.float64) ** 2))
    jitter_rms = np.sqrt(1.0 + 1.0 / 12.0)
    return float(sigma / (q_std * sc_rms * jitter_rms))


def random_bits(nbytes: int, seed: np.random.SeedSequence, pool: ThreadPoolExecutor
                ) -> np.ndarray:
    """`nbytes` uniform random bytes (uint8), chunked over the pool."""
    words = -(-nbytes // 8)
    out = np.empty(words, dtype=np.uint64)
    bounds = list(range(0, words, _CHUNK_WORDS)) + [words]
    seeds = seed.spawn(len(bounds) - 1)

    def fill(k: int) -> None:
        lo, hi = bounds[k], bounds[k + 1]
        out[lo:hi] = np.random.default_rng(seeds[k]).integers(
            0, np.iinfo(np.uint64).max, hi - lo, dtype=np.uint64, endpoint=True)

    list(pool.map(fill, range(len(bounds) - 1)))
    return out.view(np.uint8)[:nbytes]


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _pack_kquant_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes holding 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4
    reads sub-blocks 0-3 from the low 6 bits of bytes 0-7, sub-blocks 4-7 from the nibbles of
    bytes 8-11 plus the top 2 bits of bytes 0-7)."""
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def random_blocks(qtype: int, rows: int, cols: int, sigma: float, seed: np.random.SeedSequence,
                  pool: ThreadPoolExecutor) -> np.ndarray:
    """uint8 [rows, row_bytes] of `qtype` blocks whose values have mean 0 and std `sigma`."""
    bits_seed, field_seed = seed.spawn(2)
    nbytes = rows * row_bytes(qtype, cols)
    raw = random_bits(nbytes, bits_seed, pool).reshape(-1, BLOCKS[qtype][1])
    rng = np.random.default_rng(field_seed)
    nb = raw.shape[0]
    d = base_scale(qtype, sigma) * rng.uniform(0.5, 1.5, nb)
    if qtype in (Q4_K, Q5_K):
        sc = rng.integers(*(_LEVELS[qtype][1][0], _LEVELS[qtype][1][1] + 1), (nb, 8),
                          dtype=np.uint8)
        mid2 = _LEVELS[qtype][0] - 1          # twice the mean level: 15 (Q4_K), 31 (Q5_K)
        m = ((mid2 * sc.astype(np.uint16) + rng.integers(0, 2, (nb, 8))) // 2).astype(np.uint8)
        raw[:, 0:2] = _f16_bytes(d)
        raw[:, 2:4] = raw[:, 0:2]             # dmin = d
        raw[:, 4:16] = _pack_kquant_scales(sc, m)
    elif qtype == Q6_K:
        sc = rng.integers(1, 17, (nb, 16)) * rng.choice(np.array([-1, 1]), (nb, 16))
        raw[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        raw[:, 208:210] = _f16_bytes(d)
    elif qtype == Q5_1:
        raw[:, 0:2] = _f16_bytes(d)
        raw[:, 2:4] = _f16_bytes(-15.5 * d.astype(np.float16).astype(np.float64))
    else:                                      # Q8_0, Q5_0: d of random sign
        raw[:, 0:2] = _f16_bytes(d * rng.choice(np.array([-1.0, 1.0]), nb))
    return raw.reshape(rows, -1)


def random_f32(shape: tuple[int, ...], sigma: float, seed: np.random.SeedSequence
               ) -> np.ndarray:
    """float32 normal values of std `sigma` (a router)."""
    return (np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * sigma)
