"""Which decode GEMV a quantized GPU projection runs (FREETOKEN_QUANT_GEMV).

v1: ``gguf_matmul`` / ``scaled_gemv`` for every weight. v2: ``gguf_gemv`` / ``fp8_gemv``
(kernels/cuda/quant_gemv.cu) for the weights they read, v1 for the rest. v3: v2, and for GGUF
weights at steps of up to ``Q8_MAX_TOKENS`` tokens ``gguf_gemv_q8`` (kernels/cuda/
gguf_gemv_q8.cu: int8 activations, dp4a), which the fused decode step (fused_decode.py) also
takes for GGUF projections, as it takes fp8_gemv_fused for FP8 ones. Prefill batches (more than ``GEMV_MAX_TOKENS`` rows) keep their GEMM
either way.
"""

from __future__ import annotations

from typing import Any, Callable

from freetoken import env

GEMV_MAX_TOKENS = 8                 # kernels/cuda/quant_gemv.cu kMaxTokens
# kernels/cuda/gguf_gemv_q8.cu kMaxTokens: Q4_K, Q6_K and Q8_0 (the types that hold most of a
# K-quant or Q8_0 file's bytes) take up to 8 tokens, the others kMaxTokensOther
Q8_MAX_TOKENS = 8
Q8_EIGHT_TOKEN_TYPES = (12, 14, 8)
Q8_MAX_TOKENS_OTHER = 2
# The types gguf_gemv_q8 reads, (weights, bytes) per block: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
# Q4_K, Q5_K, Q6_K
Q8_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
             13: (256, 176), 14: (256, 210)}
Q8_STORE, Q8_ADD, Q8_SWIGLU = 0, 1, 2   # its modes (epilogues)


def q8_capacity(qtype: int) -> int:
    """int8 x values (T * K) a block of gguf_gemv_q8 stages: kXCapacity for Q4_K (read straight
    from memory), kStagedCapacity for the types it stages through shared memory."""
    return 32768 if qtype == 12 else 24576
GGUF_TYPES = (2, 6, 7, 8, 12, 14)   # Q4_0, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K: what gguf_gemv reads
FP8 = 0                             # scaled_gemv's format id for FP8 e4m3
# Weight rows per warp at a 1-token step (0: the kernel's own rule, 1 at one token, 2 above),
# the fastest summed over the Qwen3-8B projections in benchmarks/quant_gemv_sweep.py on an H200.
GGUF_ROWS_ONE_TOKEN = {2: 4, 8: 4, 12: 1, 14: 4}   # Q4_0, Q8_0, Q4_K, Q6_K
FP8_ROWS_ONE_TOKEN = 2


def gguf_rows(qtype: int, tokens: int) -> int:
    """gguf_gemv's rows-per-warp argument for a step of `tokens` rows."""
    return GGUF_ROWS_ONE_TOKEN.get(qtype, 0) if tokens == 1 else 0


def fp8_rows(tokens: int) -> int:
    """fp8_gemv's rows-per-warp argument for a step of `tokens` rows."""
    return FP8_ROWS_ONE_TOKEN if tokens == 1 else 0


def gguf_reads(qtype: int, row_bytes: int) -> bool:
    """gguf_gemv reads this weight: one of its types, rows a multiple of 16 bytes."""
    return qtype in GGUF_TYPES and row_bytes % 16 == 0


def q8_reads(qtype: int, cols: int, tokens: int = Q8_MAX_TOKENS) -> bool:
    """gguf_gemv_q8 reads this weight at steps of up to `tokens` tokens: one of its types, x
    within its staging (rows of whole blocks; the GPU pads each row to 16-byte words,
    weights.gpu_rows)."""
    if qtype not in Q8_BLOCKS:
        return False
    weights, _ = Q8_BLOCKS[qtype]
    most = Q8_MAX_TOKENS if qtype in Q8_EIGHT_TOKEN_TYPES else Q8_MAX_TOKENS_OTHER
    return cols % weights == 0 and tokens <= most and tokens * cols <= q8_capacity(qtype)


def q8_max_tokens(qtype: int, cols: int) -> int:
    """The most tokens one gguf_gemv_q8 call takes over this weight (0: none)."""
    return max((t for t in range(1, Q8_MAX_TOKENS + 1) if q8_reads(qtype, cols, t)), default=0)


def fp8_reads(fmt: int, block: tuple[int, int], cols: int) -> bool:
    """fp8_gemv reads this weight: FP8, scale blocks a power of two >= 16 columns wide or one
    block across the row, rows of whole 16-byte words."""
    bk = block[1]
    return (fmt == FP8 and cols % 16 == 0 and block[0] >= 1
            and (bk >= cols or (bk >= 16 and bk & (bk - 1) == 0)))


def _bind(name: str, device: Any, variants: tuple[str, ...] = ("v2", "v3")) -> Callable | None:
    # GPU kernels only: a host tensor standing in for a GPU placement keeps v1
    if env.read().quant_gemv not in variants or getattr(device, "type", None) != "cuda":
        return None
    from freetoken.kernel import ops

    return ops.bind(name, device)


def gguf_decode(qtype: int, data: Any) -> Callable | None:
    """gguf_gemv bound to data's device when v2 is selected and reads the weight, else None."""
    return _bind("gguf_gemv", data.device) if gguf_reads(qtype, data.shape[1]) else None


def q8_decode(qtype: int, cols: int, data: Any) -> Callable | None:
    """gguf_gemv_q8 bound to data's device when v3 is selected and reads the weight (at one
    token at least), else None."""
    reads = q8_reads(qtype, cols, 1) and data.shape[1] % 16 == 0   # rows padded to words
    return _bind("gguf_gemv_q8", data.device, ("v3",)) if reads else None


def fp8_decode(fmt: int, block: tuple[int, int], data: Any) -> Callable | None:
    """fp8_gemv bound to data's device when v2 is selected and reads the weight, else None."""
    return _bind("fp8_gemv", data.device) if fp8_reads(fmt, block, data.shape[1]) else None
