"""The FP8 decode GEMV runs on the host: the real kernel of kernels/cuda/fp8_gemv.cu built with
g++ against the stand-in for the CUDA vocabulary (tests/kernel/emu/freetoken/cuda_common.cuh),
launched through the kernel's own dispatch by tests/kernel/fp8_gemv_emu.cc. Evidence without a
GPU for fp8_gemv_fused's norm prologue and its three epilogues at every rows-per-warp and token
instantiation, and that the plain fp8_gemv (store, no norm) still reads its weights as before.

The reference is independent of the kernel: the e4m3 values by their bit definition
(tests/models/scaled_checkpoint.py) times the expanded scale grid and row scales, the normed
input by kernel/reference.py's rms_norm, in float64."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from tests.kernel.emulation import assert_bf16_within, build_emulation
from tests.kernel.test_gguf_gemv_q8_emulated import _normed
from tests.models.scaled_checkpoint import e4m3_values, expand, quantize_fp8
from tests.tolerances import EPS

BF16 = torch.bfloat16
STORE, ADD, SWIGLU = 0, 1, 2
ULPS = 32  # f32 ulps per sqrt(K) of the products' root-sum-square


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "fp8_gemv_emu", ctypes.c_int,
                           [ctypes.c_void_p] * 7 + [ctypes.c_long] * 2 + [ctypes.c_int] * 8
                           + [ctypes.c_float])


def _ptr(t):
    return None if t is None else t.data_ptr()


def _weight(rows: int, k: int, block: tuple[int, int], seed: int):
    """(e4m3 bytes, float32 grid, row scales, float64 weight) of a random [rows, k] matrix."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g) * 0.05
    q, grid = quantize_fp8(w, *block)
    row_scale = (torch.rand(rows, generator=g) + 0.5).float()
    values = (e4m3_values(q.view(torch.uint8).numpy())
              * expand(grid.double().numpy(), *block, rows, k)
              * row_scale.double().numpy()[:, None])
    return q.view(torch.uint8).contiguous(), grid.contiguous(), row_scale, values


def _run(fn, out, x, data, grid, row_scale, block, bias=None, norm=None, mode=STORE, rows=0):
    t, k = x.shape
    bk = block[1]
    shift = 30 if bk >= k else int(math.log2(bk))
    ok = fn(_ptr(out), _ptr(x), _ptr(data), _ptr(grid), _ptr(row_scale), _ptr(bias), _ptr(norm),
            x.stride(0), out.stride(0), t, data.shape[0], k, block[0], shift, grid.shape[1], mode,
            rows, 1e-6)
    assert ok, "the configuration was refused"


def _bound(xn: torch.Tensor, w: np.ndarray, norm: bool) -> np.ndarray:
    """f32 order over K terms (magnitude the products' root-sum-square), and with the norm a few
    normed elements whose bf16 rounding flips between two float32 orders."""
    x = xn.double().numpy()
    order = ULPS * EPS["float32"] * np.sqrt((x ** 2) @ (w ** 2).T) * math.sqrt(w.shape[1])
    flips = 4 * EPS["bfloat16"] * np.abs(x).max() * np.abs(w).max() if norm else 0.0
    return order + flips


def _x(t: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k + 8, generator=g).to(BF16)[:, :k]      # strided, 16-byte aligned rows
    nw = (1 + 0.3 * torch.randn(k, generator=g)).to(BF16)
    return x, nw, g


# (tokens, N, K, block): 128 x 128 blocks with a cut last block column, per channel, per tensor
CASES = [(1, 37, 4096 + 16, (128, 128)), (2, 24, 1040, (128, 128)), (3, 19, 2048, (1, 2048)),
         (8, 9, 336, (9, 336))]


@pytest.mark.parametrize("t,n,k,block", CASES)
@pytest.mark.parametrize("rows", (0, 1, 2, 4))
@pytest.mark.parametrize("norm", (False, True), ids=("x", "normed"))
def test_store_with_norm_and_bias(emulated, t, n, k, block, rows, norm):
    data, grid, row_scale, w = _weight(n, k, block, seed=n + k)
    x, nw, g = _x(t, k, seed=t + rows)
    bias = torch.randn(n, generator=g).to(BF16)
    xn = _normed(x, nw, norm)
    for with_bias in (False, True):
        whole = torch.full((t, n + 5), float("nan"), dtype=BF16)
        out = whole[:, 2:2 + n]
        _run(emulated, out, x, data, grid, row_scale, block, bias if with_bias else None,
             nw if norm else None, STORE, rows)
        want = xn.double().numpy() @ w.T + (bias.double().numpy() if with_bias else 0.0)
        assert_bf16_within(out, want, _bound(xn, w, norm), f"bias={with_bias}")
        assert torch.isnan(whole[:, :2]).all() and torch.isnan(whole[:, 2 + n:]).all()


@pytest.mark.parametrize("t,n,k,block,rows", [(1, 33, 4096, (128, 128), 0),
                                              (4, 16, 1024, (1, 1024), 2)])
def test_residual_add(emulated, t, n, k, block, rows):
    data, grid, row_scale, w = _weight(n, k, block, seed=7 * n)
    x, _, g = _x(t, k, seed=n)
    residual = torch.randn(t, n, generator=g).to(BF16)
    prod = x.double().numpy() @ w.T
    out = residual.clone()
    _run(emulated, out, x, data, grid, row_scale, block, mode=ADD, rows=rows)
    want = residual.double().numpy() + prod
    bound = _bound(x, w, False) + 2 * EPS["bfloat16"] * (np.abs(prod) + np.abs(want))
    assert_bf16_within(out, want, bound, "residual add")


@pytest.mark.parametrize("t,inter,k,block,rows,norm", [(1, 20, 4096, (128, 128), 0, True),
                                                       (2, 13, 1024, (1, 1024), 2, False),
                                                       (4, 9, 512, (128, 128), 1, True)])
def test_swiglu(emulated, t, inter, k, block, rows, norm):
    data, grid, row_scale, w = _weight(2 * inter, k, block, seed=inter + k)
    x, nw, _ = _x(t, k, seed=inter)
    xn = _normed(x, nw, norm)
    gu = xn.double().numpy() @ w.T
    gate, up = gu[:, :inter], gu[:, inter:]
    silu = gate / (1 + np.exp(-gate))
    want = silu * up
    out = torch.full((t, inter), float("nan"), dtype=BF16)
    _run(emulated, out, x, data, grid, row_scale, block, norm=nw if norm else None, mode=SWIGLU,
         rows=rows)
    lim = _bound(xn, w, norm) + 2 * EPS["bfloat16"] * np.abs(gu)   # g, u and their rounding
    lg, lu = lim[:, :inter], lim[:, inter:]
    bound = 1.1 * lg * np.abs(up) + np.abs(silu) * lu + lg * lu
    assert_bf16_within(out, want, bound, "swiglu")


def test_refuses_what_the_entry_point_refuses(emulated):
    data, grid, row_scale, _ = _weight(8, 256, (128, 128), seed=0)
    x, _, _ = _x(1, 256, seed=0)
    out = torch.zeros(1, 8, dtype=BF16)
    head = (_ptr(out), _ptr(x), _ptr(data), _ptr(grid), _ptr(row_scale), None, None,
            x.stride(0), 8)
    assert emulated(*head, 1, 8, 256, 128, 7, 2, STORE, 0, 1e-6)
    assert not emulated(*head, 9, 8, 256, 128, 7, 2, STORE, 0, 1e-6)    # 9 tokens
    assert not emulated(*head, 1, 8, 256, 128, 3, 2, STORE, 0, 1e-6)    # 8-wide blocks
    assert not emulated(*head, 1, 8, 256, 128, 7, 2, STORE, 3, 1e-6)    # rows per warp
    assert not emulated(*head, 1, 7, 256, 128, 7, 2, SWIGLU, 0, 1e-6)   # odd gate_up rows
