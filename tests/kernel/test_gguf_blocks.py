"""The GPU kernels' GGUF block decoding (kernels/include/freetoken/gguf_blocks.h), built for
the host and checked against gguf's numpy dequantizer: evidence without a GPU that every type
the GPU reads decodes to the file's values."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.kernel.gguf_random import BLOCKS, NAMES, dequantize, random_blocks, row_bytes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def host_decoder(tmp_path_factory):
    """ft_gguf_dequantize(data, qtype, rows, cols, row_bytes, out) from a host build."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    so = tmp_path_factory.mktemp("gguf-host") / "gguf_blocks_host.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror",
                    f"-I{REPO / 'kernels' / 'include'}",
                    str(Path(__file__).with_name("gguf_blocks_host.cc")), "-o", str(so)],
                   check=True)
    fn = ctypes.CDLL(str(so)).ft_gguf_dequantize
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p]

    lib = ctypes.CDLL(str(so))
    dot = lib.ft_gguf_dot
    dot.restype = ctypes.c_int
    dot.argtypes = fn.argtypes[:5] + [ctypes.c_void_p, ctypes.c_void_p]

    def decode(blocks: np.ndarray, qtype: int, cols: int) -> np.ndarray | None:
        blocks = np.ascontiguousarray(blocks)
        out = np.full((blocks.shape[0], cols), np.nan, dtype=np.float32)
        ok = fn(blocks.ctypes.data, qtype, blocks.shape[0], cols, blocks.shape[1],
                out.ctypes.data)
        return out if ok else None

    def dot_rows(blocks: np.ndarray, qtype: int, x: np.ndarray) -> np.ndarray:
        blocks, x = np.ascontiguousarray(blocks), np.ascontiguousarray(x, dtype=np.float32)
        out = np.full(blocks.shape[0], np.nan, dtype=np.float32)
        assert dot(blocks.ctypes.data, qtype, blocks.shape[0], x.size, blocks.shape[1],
                   x.ctypes.data, out.ctypes.data)
        return out

    decode.dot = dot_rows
    return decode


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_block_decoding_matches_gguf(host_decoder, qtype):
    rng = np.random.default_rng(qtype)
    cols = 1024
    blocks = random_blocks(qtype, 24, cols, rng)
    ours = host_decoder(blocks, qtype, cols)
    expected = dequantize(blocks, qtype)
    # every product here is exact in float32 (an f16 scale times integers of <= 13 bits), so
    # only the one final add or subtract rounds: within one float32 ulp of the value
    np.testing.assert_allclose(ours, expected, rtol=2.0 ** -23, atol=0)
    assert np.abs(expected).max() > 0


@pytest.mark.parametrize("qtype", [12, 14], ids=lambda t: NAMES[t])
def test_subnormal_and_special_scales(host_decoder, qtype):
    """f16 scales at the edges (subnormal, zero, negative) decode as gguf reads them."""
    rng = np.random.default_rng(1)
    blocks = random_blocks(qtype, 4, 256, rng).reshape(4, 1, -1)
    field = 208 if qtype == 14 else 0
    for row, value in enumerate((3e-7, 0.0, -2e-3, 6.1e-5)):
        blocks[row, 0, field:field + 2] = np.array([value], np.float16).view(np.uint8)
    blocks = blocks.reshape(4, -1)
    np.testing.assert_allclose(host_decoder(blocks, qtype, 256), dequantize(blocks, qtype),
                               rtol=2.0 ** -23, atol=0)


def test_unknown_type_or_ragged_row_is_refused(host_decoder):
    blocks = np.zeros((2, row_bytes(12, 256)), np.uint8)
    assert host_decoder(blocks, 6, 256) is None            # Q5_0: not read here
    assert host_decoder(blocks, 12, 128) is None           # half a Q4_K block


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_gemv_dot_products_match_gguf(host_decoder, qtype):
    """dot32 (the GEMV's inner product: scales folded out of float sums) against float64
    products of gguf's dequantized rows. float32 sums of K terms of |q x|, each within a few
    ulps, plus Q8_0's offset of 128 * sum(x) (q read as q + 128) and the K-quant minimums:
    bounded by K * eps32 * sum |x| * (max |w| + the offset it carries)."""
    rng = np.random.default_rng(qtype + 50)
    cols = 2048
    blocks = random_blocks(qtype, 32, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    w = dequantize(blocks, qtype).astype(np.float64)
    expected = w @ x.astype(np.float64)
    ours = host_decoder.dot(blocks, qtype, x)
    offset = 256 * np.abs(w).max(axis=1, keepdims=True)   # what any folded offset can reach
    tol = cols * 2.0 ** -23 * (np.abs(x) * (np.abs(w) + offset)).sum(axis=1)
    assert (np.abs(ours - expected) <= tol).all(), np.abs(ours - expected).max()
    assert np.abs(ours - expected).max() < 1e-3 * np.abs(expected).max()   # far below a bug
