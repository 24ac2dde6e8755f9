"""The small-step MoE decode kernels run on the host: the real kernel bodies
(kernels/include/freetoken/moe_decode_kernels.cuh) built with g++ against the CUDA stand-in of
tests/kernel/emu (one CPU thread per GPU thread, barriers for __syncthreads and warp sums,
aborts on misaligned vector loads), launched as moe_decode.cu launches them. Evidence without a
GPU for the index math: expert ownership across tokens, the offload expert map, the shared
expert and its gate, the unrolled loops' tails, accumulate. Same bound as the GPU test."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from tests.kernel.emulation import build_emulation
from tests.kernel.moe_decode_ref import assert_within, reference_decode

# I: 17 16-byte vectors, so the down loop over K * I / 8 = 136 vectors takes two unrolled passes
# of a warp (4 x 32), the second partial; H = 1096 (137 vectors) does the same for gate/up in
# one test (H = 264 elsewhere: the emulation runs ~60 blocks a second).
E, K, INTER, SHARED = 10, 8, 136, 136
H_SMALL, H_TAILS = 264, 1096


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "moe_decode_emu", None,
                           [ctypes.c_void_p] * 13 + [ctypes.c_int] * 9)


def _bits(t):
    return np.ascontiguousarray(t.view(torch.int16).numpy())


def _case(T, seed, shared, gated, crowd=False, H=H_SMALL):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    slots = E + 2
    w13 = (torch.randn(slots, 2 * INTER, H, generator=g) / math.sqrt(H)).to(bf)
    w2 = (torch.randn(slots, H, INTER, generator=g) / math.sqrt(INTER)).to(bf)
    x = torch.randn(T, H, generator=g).to(bf)
    logits = torch.randn(T, E, generator=g)
    if crowd:
        logits[:, K + 1:] -= 100.0            # every token in the same K + 1 experts
    w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
    emap = torch.randperm(slots, generator=g)[:E].to(torch.int32)
    emap[ids[0, -1]] = -1                     # computed elsewhere by the offload cache
    sh = None
    if shared:
        sh = ((torch.randn(2 * SHARED, H, generator=g) / math.sqrt(H)).to(bf),
              (torch.randn(H, SHARED, generator=g) / math.sqrt(SHARED)).to(bf),
              (torch.randn(1, H, generator=g) / math.sqrt(H)).to(bf) if gated else None)
    return x, w13, w2, ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float(), emap, sh


def _run(fn, case, residual=None, variant=0):
    x, w13, w2, ids, weights, emap, sh = case
    T, H = x.shape
    out = _bits(residual) if residual is not None else np.full((T, H), 0x7FC0, np.uint16)
    out = out.view(np.uint16).copy()
    keep = [_bits(x), _bits(w13), _bits(w2), ids.numpy(), weights.numpy(), emap.numpy(),
            np.zeros(T * K * INTER, np.uint16)]
    null = ctypes.c_void_p(None)
    sh_args, si = [null] * 5, 0
    if sh is not None:
        si = SHARED
        keep += [_bits(sh[0]), _bits(sh[1]), np.zeros((T, si), np.uint16)]
        sh_args = [keep[7].ctypes.data, keep[8].ctypes.data, keep[9].ctypes.data, null, null]
        if sh[2] is not None:
            keep += [_bits(sh[2]), np.zeros((T, 1), np.uint16)]
            sh_args[3:] = [keep[10].ctypes.data, keep[11].ctypes.data]
    fn(out.ctypes.data, *[a.ctypes.data for a in keep[:7]], *sh_args, T, K, E, w13.shape[0], H,
       INTER, si, int(residual is not None), variant)
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def _check(out, case, add=None):
    x, w13, w2, ids, weights, emap, sh = case
    ref, bound = reference_decode(x, w13, w2, ids, weights, emap, sh)
    if add is not None:
        ref, bound = (add.float() + ref).to(torch.bfloat16).float(), bound + 2 ** -6 * add.abs()
    assert_within(out, ref, bound)


@pytest.mark.parametrize("T,H", [(1, H_SMALL), (2, H_TAILS), (8, H_SMALL)])
def test_routed_experts(emulated, T, H):
    case = _case(T, T, shared=False, gated=False, H=H)
    _check(_run(emulated, case), case)


@pytest.mark.parametrize("T,gated", [(2, True), (4, False)])
def test_shared_expert(emulated, T, gated):
    case = _case(T, 10 + T, shared=True, gated=gated)
    _check(_run(emulated, case), case)


def test_tokens_sharing_experts_and_accumulate(emulated):
    case = _case(6, 21, shared=True, gated=True, crowd=True)
    residual = torch.randn(6, H_SMALL).to(torch.bfloat16)
    _check(_run(emulated, case, residual), case, add=residual)


def test_a_wrong_expert_map_fails_the_check(emulated):
    """The check can fail: the same weights read through another slot map are far off."""
    case = list(_case(1, 5, shared=False, gated=False))
    out = _run(emulated, case)
    case[5] = torch.roll(case[5], 1)
    with pytest.raises(AssertionError):
        _check(out, case)


@pytest.mark.parametrize("variant", [1, 2, 4, 6])  # 3, 5: register cap, pdl only
def test_launch_variants(emulated, variant):
    """The other launch shapes (8 loads per row in flight; two rows per warp), built for steps
    of up to 2 tokens: H = 1096 and I = 136 leave a partial unrolled pass and a last tile of
    half-used warps; the tokens share experts, the gated shared expert and accumulate run too."""
    case = _case(2, 30 + variant, shared=True, gated=True, crowd=True, H=H_TAILS)
    residual = torch.randn(2, H_TAILS).to(torch.bfloat16)
    _check(_run(emulated, case, residual, variant), case, add=residual)


@pytest.mark.parametrize("variant", [5, 6])
def test_streamed_variants_at_one_token(emulated, variant):
    """The 1-token launches decode runs (moe_decode.GATE_UP_VARIANT / DOWN_VARIANT): one token,
    the gated shared expert, an unmapped expert, accumulate into the residual."""
    case = _case(1, 60 + variant, shared=True, gated=True, H=H_TAILS)
    residual = torch.randn(1, H_TAILS).to(torch.bfloat16)
    _check(_run(emulated, case, residual, variant), case, add=residual)
