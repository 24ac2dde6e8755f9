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

    dot_q8 = lib.ft_gguf_dot_q8
    dot_q8.restype = ctypes.c_int
    dot_q8.argtypes = fn.argtypes[:5] + [ctypes.c_void_p] * 3

    def dot_q8_rows(blocks: np.ndarray, qtype: int, xq: np.ndarray, dx: np.ndarray) -> np.ndarray:
        blocks = np.ascontiguousarray(blocks)
        xq, dx = np.ascontiguousarray(xq, dtype=np.int8), np.ascontiguousarray(dx, np.float32)
        out = np.full(blocks.shape[0], np.nan, dtype=np.float32)
        assert dot_q8(blocks.ctypes.data, qtype, blocks.shape[0], xq.size, blocks.shape[1],
                      xq.ctypes.data, dx.ctypes.data, out.ctypes.data)
        return out

    decode.dot = dot_rows
    decode.dot_q8 = dot_q8_rows
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


@pytest.mark.parametrize("qtype", [6, 7, 12, 14], ids=lambda t: NAMES[t])
def test_subnormal_and_special_scales(host_decoder, qtype):
    """f16 scales at the edges (subnormal, zero, negative) decode as gguf reads them (the d of
    each row's first block; Q5_1's m too)."""
    rng = np.random.default_rng(1)
    blocks = random_blocks(qtype, 4, 256, rng)
    first = blocks[:, :BLOCKS[qtype][1]]
    fields = {6: (0,), 7: (0, 2), 12: (0,), 14: (208,)}[qtype]
    for row, value in enumerate((3e-7, 0.0, -2e-3, 6.1e-5)):
        for field in fields:
            first[row, field:field + 2] = np.array([value], np.float16).view(np.uint8)
    np.testing.assert_allclose(host_decoder(blocks, qtype, 256), dequantize(blocks, qtype),
                               rtol=2.0 ** -23, atol=0)


def test_unknown_type_or_ragged_row_is_refused(host_decoder):
    blocks = np.zeros((2, row_bytes(12, 256)), np.uint8)
    assert host_decoder(blocks, 10, 256) is None           # Q2_K: not read here
    assert host_decoder(blocks, 12, 128) is None           # half a Q4_K block
    assert host_decoder(blocks, 6, 48) is None             # a Q5_0 block and a half


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


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales per group of 32, as gguf_gemv_q8 stages x (the check does
    not depend on how they were chosen: kernel and reference take the same ones)."""
    groups = x.reshape(-1, 32)
    dx = (np.abs(groups).max(axis=1) / np.float32(127)).astype(np.float32)
    q = np.rint(groups / np.where(dx > 0, dx, 1)[:, None]).clip(-127, 127)
    return q.astype(np.int8).reshape(-1), dx


@pytest.mark.parametrize("qtype", sorted(BLOCKS), ids=lambda t: NAMES[t])
def test_int8_dot_products_match_gguf(host_decoder, qtype):
    """dot32_q8 (gguf_gemv_q8's inner product: integer sums of quants and int8 x, the scales
    and folded offsets applied per unit in float32) against float64 products of gguf's
    dequantized rows with the dequantized int8 x. Bounded as the float dot32 above, with x the
    int8 values times their group's scale."""
    rng = np.random.default_rng(qtype + 90)
    cols = 2048
    blocks = random_blocks(qtype, 32, cols, rng)
    xq, dx = quantize_x(rng.standard_normal(cols).astype(np.float32))
    x = xq.astype(np.float64) * np.repeat(dx.astype(np.float64), 32)
    w = dequantize(blocks, qtype).astype(np.float64)
    expected = w @ x
    ours = host_decoder.dot_q8(blocks, qtype, xq, dx)
    offset = 256 * np.abs(w).max(axis=1, keepdims=True)
    tol = cols * 2.0 ** -23 * (np.abs(x) * (np.abs(w) + offset)).sum(axis=1)
    assert (np.abs(ours - expected) <= tol).all(), np.abs(ours - expected).max()
    assert np.abs(ours - expected).max() < 1e-3 * np.abs(expected).max()
