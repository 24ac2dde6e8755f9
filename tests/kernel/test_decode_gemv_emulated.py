"""The decode GEMV runs on the host: the real kernel of kernels/cuda/decode_gemv.cu built with
g++ against the stand-in for the CUDA vocabulary (tests/kernel/emu/freetoken/cuda_common.cuh:
one CPU thread per GPU thread, barriers for __syncthreads and the warp sums, aborts on
misaligned vector accesses), launched by tests/kernel/decode_gemv_emu.cc. Evidence without a
GPU for every variant's index math (block size, unroll, pipelined loads), the token-count
instantiations, groups, the norm prologue and the epilogues, against the plain-torch chain
(kernel/reference.py) with test_decode_fused_cuda.py's bounds. Cache hints and programmatic
launch are GPU-only (plain loads, no waits here, as on HIP)."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from freetoken.kernel import reference
from freetoken.models.forward import fused_decode
from tests.kernel.emulation import build_emulation
from tests.tolerances import EPS, assert_close

BF16 = torch.bfloat16
ULPS = 32  # f32 ulps of sum |x w| per sqrt(K), the fast-math allowance of the GPU tests


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "decode_gemv_emu", ctypes.c_int,
                           [ctypes.c_void_p] * 5 + [ctypes.c_long] + [ctypes.c_int] * 6
                           + [ctypes.c_float])


def _ptr(t):
    return None if t is None else t.data_ptr()


def _run(fn, out, x, w, bias, norm, group, variant, mode, eps=1e-6):
    t, k = x.shape
    ok = fn(_ptr(out), _ptr(x), _ptr(w), _ptr(bias), _ptr(norm), x.stride(0), t,
            out.shape[1], k, group, variant, mode, eps)
    assert ok, "the configuration was refused"


def _case(t, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k + 8, generator=g).to(BF16)[:, :k]  # rows 16-byte aligned, strided
    w = (torch.randn(n, k, generator=g) / math.sqrt(k)).to(BF16)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(BF16)
    return x, w, nw, g


def _limit(xn, w, ref):
    """test_decode_fused_cuda's _assert_dot_close bound: the f32 order error, a few flipped
    normed elements, two ulps of the result."""
    order = ULPS * EPS["float32"] * (xn.float().abs() @ w.float().abs().T) * math.sqrt(w.shape[1])
    flips = 4 * EPS["bfloat16"] * (xn.float().abs().max() * w.float().abs().max())
    return order + flips + 2 * EPS["bfloat16"] * ref.float().abs()


VARIANTS = range(len(fused_decode.GEMV_VARIANTS))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,n,k,group", [(1, 40, 512, 32), (2, 24, 1024, 64),
                                         (3, 9, 2048, 128), (8, 5, 256, 32)])
def test_plain_with_norm_and_bias(emulated, variant, t, n, k, group):
    group = min(group, fused_decode.GEMV_VARIANTS[variant].threads)
    x, w, nw, g = _case(t, n, k, seed=variant * 100 + t)
    bias = torch.randn(n, generator=g).to(BF16)
    xn = torch.empty_like(x)
    reference.rms_norm(xn, x, nw, 1e-6)
    ref = (xn.float() @ w.float().T + bias.float()).to(BF16)
    out = torch.full((t, n), float("nan"), dtype=BF16)
    _run(emulated, out, x, w, bias, nw, group, variant, mode=0)
    err = (out.float() - ref.float()).abs()
    assert (err <= _limit(xn, w, ref)).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,n,k,group", [(1, 33, 768, 32), (4, 16, 1536, 128)])
def test_residual_add(emulated, variant, t, n, k, group):
    group = min(group, fused_decode.GEMV_VARIANTS[variant].threads)
    x, w, _, g = _case(t, n, k, seed=variant + 7 * t)
    residual = torch.randn(t, n, generator=g).to(BF16)
    prod = (x.float() @ w.float().T).to(BF16)
    ref = (residual.float() + prod.float()).to(BF16)
    out = residual.clone()
    _run(emulated, out, x, w, None, None, group, variant, mode=1)
    order = ULPS * EPS["float32"] * (x.float().abs() @ w.float().abs().T) * math.sqrt(k)
    assert_close(out, ref, BF16, magnitude=(prod.float().abs() + order / EPS["bfloat16"]).numpy(),
                 ulps=2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("t,inter,k,group,norm", [(1, 20, 512, 32, True),
                                                  (2, 12, 1024, 64, False)])
def test_swiglu(emulated, variant, t, inter, k, group, norm):
    group = min(group, fused_decode.GEMV_VARIANTS[variant].threads)
    x, w, nw, _ = _case(t, 2 * inter, k, seed=variant + 3 * t)
    xn = x
    if norm:
        xn = torch.empty_like(x)
        reference.rms_norm(xn, x, nw, 1e-6)
    want = torch.empty(t, inter, dtype=BF16)
    reference.decode_gemv_swiglu(want, xn, w, None, 1e-6, group)
    out = torch.full((t, inter), float("nan"), dtype=BF16)
    _run(emulated, out, x, w, None, nw if norm else None, group, variant, mode=2)
    # g and u each within the dot bound; silu(g) u moves by it times |silu'| < 1.1 and |silu|
    gu = xn.float() @ w.float().T
    lim = _limit(xn, w, gu)
    gate, up = gu[:, :inter], gu[:, inter:]
    bound = (1.1 * lim[:, :inter] * up.abs() + torch.nn.functional.silu(gate).abs()
             * lim[:, inter:] + lim[:, :inter] * lim[:, inter:] + 2 * EPS["bfloat16"]
             * want.float().abs())
    err = (out.float() - want.float()).abs()
    assert (err <= bound).all(), f"max error {err.max():.3g}"


def test_refuses_what_the_entry_point_refuses(emulated):
    x, w, _, _ = _case(1, 8, 256, seed=0)
    out = torch.zeros(1, 8, dtype=BF16)
    count = len(fused_decode.GEMV_VARIANTS)
    assert not emulated(_ptr(out), _ptr(x), _ptr(w), None, None, x.stride(0), 1, 8, 256, 32,
                        count, 0, 1e-6)
    small = next(i for i, v in enumerate(fused_decode.GEMV_VARIANTS) if v.threads == 128)
    assert not emulated(_ptr(out), _ptr(x), _ptr(w), None, None, x.stride(0), 1, 8, 256, 256,
                        small, 0, 1e-6)
