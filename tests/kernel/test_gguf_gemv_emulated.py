"""The float-activation GGUF decode GEMV (gguf_gemv, the default v2 path) runs on the host: the
real kernel of kernels/cuda/quant_gemv.cu built with g++ against the CUDA stand-in and launched
by tests/kernel/gguf_gemv_emu.cc. Evidence without a GPU for its chunked staging
(freetoken/gguf_stage.cuh's for_each_unit, shared with gguf_gemv_q8), every type, rows per
warp and token bucket, against gguf's numpy dequantizer in float64 with the GPU test's bound
(tests/kernel/test_quant_gemv.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.kernel.emulation import build_emulation
from tests.kernel.gguf_random import NAMES, dequantize, random_blocks
from tests.kernel.test_gguf_gemm import _check

N = 37  # odd: the last warp's rows run past N
# K per type: one chunk and several chunks with a partial last one, rows whole 16-byte words
GGUF_K = {2: (256, 8192), 6: (256, 8192), 7: (64, 6016), 8: (256, 4352), 12: (256, 7680),
          14: (2048, 6144)}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "gguf_gemv_emu", ctypes.c_int,
                           [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                           + [ctypes.c_long] * 2 + [ctypes.c_int] + [ctypes.c_long] * 2
                           + [ctypes.c_int] * 2)


@pytest.mark.parametrize("qtype", sorted(GGUF_K), ids=lambda t: NAMES[t])
@pytest.mark.parametrize("size", (0, 1), ids=("one-chunk", "chunks"))
@pytest.mark.parametrize("rows", (0, 1, 2, 4))
def test_gguf_gemv_matches_the_dequantized_weights(emulated, qtype, size, rows):
    k = GGUF_K[qtype][size]
    blocks = random_blocks(qtype, N, k, np.random.default_rng(qtype * 31 + k))
    w = torch.from_numpy(dequantize(blocks, qtype)).double()
    for t in (1, 3, 8):
        x = torch.randn(t, k + 8, generator=torch.Generator().manual_seed(t)).to(
            torch.bfloat16)[:, :k]
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.full((t, N), float("nan"), dtype=dtype)
            assert emulated(out.data_ptr(), int(dtype == torch.float32), x.data_ptr(),
                            blocks.ctypes.data, x.stride(0), N, t, N, k, qtype, rows)
            _check(out, x, w, gemm=False)


def test_refuses_what_the_entry_point_refuses(emulated):
    out = torch.zeros(1, 4)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    blocks = np.zeros((4, 176), dtype=np.uint8)
    assert not emulated(out.data_ptr(), 1, x.data_ptr(), blocks.ctypes.data, 256, 4, 1, 4, 256,
                        13, 0)                                   # Q5_K: gguf_matmul's
    assert not emulated(out.data_ptr(), 1, x.data_ptr(), blocks.ctypes.data, 256, 4, 9, 4, 256,
                        12, 0)                                   # 9 tokens
    assert not emulated(out.data_ptr(), 1, x.data_ptr(), blocks.ctypes.data, 256, 4, 1, 4, 128,
                        6, 0)                                    # Q5_0: 88 bytes, not words
