"""A decode graph captured at P rows runs the small-step MoE decode kernels over the step's B real
rows and P - B padding rows (whatever the padding rows' hidden states route to). The real rows
must come out bitwise as an eager step of B rows gives them: the launch at P rows is another
instantiation (gate/up's NT = 2, 4, 8 tokens per expert owner), padding rows share the real
rows' experts (so one owner block computes both), and the activation workspace holds whatever
the step before left there (poisoned here with NaN: a read of an unwritten activation shows).

Run on the host through the emulation of test_moe_decode_emulated.py (the real kernel bodies);
tests/kernel/test_moe_decode_graph.py replays a captured step on a GPU."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from tests.kernel.moe_decode_ref import assert_within, reference_decode
from tests.kernel.test_moe_decode_emulated import _bits, emulated  # noqa: F401 (a fixture)

# Small enough for the emulation (~60 blocks a second): I = 64 is 8 vectors of a row, and the
# down loop over K * I / 8 = 32 vectors leaves 3 of a warp's 4 unrolled loads empty.
E, K, INTER, SHARED, H = 12, 4, 64, 64, 264
NAN_BITS = 0x7FC0


def _weights(seed: int, shared: bool):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    slots = E + 1
    w13 = (torch.randn(slots, 2 * INTER, H, generator=g) / math.sqrt(H)).to(bf)
    w2 = (torch.randn(slots, H, INTER, generator=g) / math.sqrt(INTER)).to(bf)
    emap = torch.randperm(slots, generator=g)[:E].to(torch.int32)
    sh = None
    if shared:
        sh = ((torch.randn(2 * SHARED, H, generator=g) / math.sqrt(H)).to(bf),
              (torch.randn(H, SHARED, generator=g) / math.sqrt(SHARED)).to(bf),
              (torch.randn(1, H, generator=g) / math.sqrt(H)).to(bf))
    return w13, w2, emap, sh


def _rows(seed: int, real: int, padded: int):
    """x, ids, weights of `padded` rows whose first `real` are the step's: the padding rows
    route into the real rows' experts in another order (one owner block runs both); distinct
    ids per row, as top-k gives them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(padded, H, generator=g).to(torch.bfloat16)
    if padded > real:
        x[real] = 0                            # a padding row of zeros
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(padded)])
    for r in range(real, padded):
        ids[r] = ids[(r - real) % real].roll(r)
    w = torch.rand(padded, K, generator=g) + 0.1
    return x, ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def _run(fn, x, ids, weights, params, residual, variant=0):
    """moe_decode_gate_up + moe_decode_down (accumulate into `residual`) over x's rows, with
    the activation workspace and the shared expert's scratch poisoned with NaN."""
    w13, w2, emap, sh = params
    T = x.shape[0]
    out = _bits(residual).view(np.uint16).copy()
    keep = [_bits(x), _bits(w13), _bits(w2), ids.numpy(), weights.numpy(), emap.numpy(),
            np.full(T * K * INTER, NAN_BITS, np.uint16)]
    null = ctypes.c_void_p(None)
    sh_args, si = [null] * 5, 0
    if sh is not None:
        si = SHARED
        keep += [_bits(sh[0]), _bits(sh[1]), np.full((T, si), NAN_BITS, np.uint16),
                 _bits(sh[2]), np.full((T, 1), NAN_BITS, np.uint16)]
        sh_args = [a.ctypes.data for a in keep[7:]]
    fn(out.ctypes.data, *[a.ctypes.data for a in keep[:7]], *sh_args, T, K, E, w13.shape[0], H,
       INTER, si, 1, variant)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("real,padded,shared", [(1, 2, False), (1, 4, True), (2, 4, True),
                                                (1, 8, False)])
def test_padding_rows_leave_the_real_rows_bitwise(emulated, real, padded, shared):  # noqa: F811
    params = _weights(real * 10 + padded, shared)
    x, ids, weights = _rows(padded, real, padded)
    emap = params[2]
    emap[ids[-1, 0]] = -1       # an expert the offload cache computes elsewhere: skipped
    residual = torch.randn(padded, H, generator=torch.Generator().manual_seed(7))
    residual = residual.to(torch.bfloat16)
    eager = _run(emulated, x[:real], ids[:real], weights[:real], params, residual[:real])
    graph = _run(emulated, x, ids, weights, params, residual)
    assert not eager.isnan().any()
    assert torch.equal(_bits_of(graph[:real]), _bits_of(eager))
    # and the real rows are the MoE MLP (the comparison is not between two wrong results)
    ref, bound = reference_decode(x[:real], params[0], params[1], ids[:real], weights[:real],
                                  emap, params[3])
    ref = (residual[:real].float() + ref).to(torch.bfloat16).float()
    assert_within(eager, ref, bound + 2 ** -6 * residual[:real].float().abs())


@pytest.mark.parametrize("variant", [1, 2, 3])
def test_the_launch_variants_give_variant_0s_bits(emulated, variant):  # noqa: F811
    """Every launch shape adds each row's products in the same order (a lane walks its 16-byte
    vectors in order, whatever the unroll or rows per warp): same bits as variant 0."""
    params = _weights(40 + variant, shared=True)
    x, ids, weights = _rows(50 + variant, 2, 2)
    residual = torch.randn(2, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    base = _run(emulated, x, ids, weights, params, residual)
    other = _run(emulated, x, ids, weights, params, residual, variant)
    assert torch.equal(_bits_of(other), _bits_of(base))


def test_the_bitwise_check_can_fail(emulated):  # noqa: F811
    """A real row routed differently in the padded run is seen: the check is not vacuous."""
    params = _weights(3, shared=False)
    x, ids, weights = _rows(3, 1, 2)
    residual = torch.zeros(2, H).to(torch.bfloat16)
    eager = _run(emulated, x[:1], ids[:1], weights[:1], params, residual[:1])
    ids = ids.clone()
    ids[0, -1] = next(e for e in range(E) if e not in ids[0].tolist())
    graph = _run(emulated, x, ids, weights, params, residual)
    assert not torch.equal(_bits_of(graph[:1]), _bits_of(eager))


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)
