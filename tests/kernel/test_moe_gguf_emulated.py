"""The GGUF MoE experts kernels run on the host: the real kernel bodies
(kernels/include/freetoken/moe_gguf_kernels.cuh, with the alignment of moe_align.cuh and the
block decoding of gguf_blocks.h) built with g++ against a stand-in for the CUDA vocabulary
(tests/kernel/emu/freetoken/cuda_common.cuh: one CPU thread per GPU thread, barriers for
__syncthreads and the warp sums, aborts on misaligned vector accesses), launched in
moe_gguf.cu's order by tests/kernel/moe_gguf_emu.cc. Evidence without a GPU for the index
math of both paths, every type and mixed gate/up and down types; the tensor-core tile itself
is not emulated (the HIP CUDA-core tile runs instead). Same bounds as test_moe_gguf_cuda.py.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tests.kernel.emulation import build_emulation
from tests.kernel.gguf_random import NAMES, dequantize, random_blocks
from tests.kernel.test_moe_cuda import UNIT, check_experts, reference_experts

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
E, K, H, INTER = 4, 2, 256, 256
DECODE_T, PREFILL_T = 3, 12          # 6 pairs take the GEMV path, 24 the tiled one (> 4 * E)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "moe_gguf_emu", ctypes.c_int,
                           [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
                           + [ctypes.c_int] * 6)


def make_case(T, q13, q2, slots, seed):
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    b13 = random_blocks(q13, slots * 2 * INTER, H, rng)
    b2 = random_blocks(q2, slots * H, INTER, rng)
    f13 = torch.from_numpy(dequantize(b13, q13)).reshape(slots, 2 * INTER, H)
    f2 = torch.from_numpy(dequantize(b2, q2)).reshape(slots, H, INTER)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    weights = torch.rand(T, K, generator=g) + 0.05
    emap = torch.randperm(slots, generator=g)[:E].to(torch.int32)
    return x, (b13, f13), (b2, f2), ids, weights, emap


def run(fn, case, q13, q2):
    x, (b13, _), (b2, _), ids, weights, emap = case
    T, slots = x.shape[0], b13.shape[0] // (2 * INTER)
    out = np.full((T, H), 0x7FC0, dtype=np.uint16)    # bf16 NaN: every element must be written
    xb = np.ascontiguousarray(x.view(torch.int16).numpy())
    args = [np.ascontiguousarray(a) for a in (b13, b2, ids.numpy(), weights.numpy(),
                                                emap.numpy())]
    ok = fn(out.ctypes.data, xb.ctypes.data, args[0].ctypes.data, args[1].ctypes.data, q13, q2,
            args[2].ctypes.data, args[3].ctypes.data, args[4].ctypes.data, T, K, E, slots, H,
            INTER)
    assert ok
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def check(fn, T, q13, q2, slots=E, seed=0):
    case = make_case(T, q13, q2, slots, seed)
    x, (_, f13), (_, f2), ids, weights, emap = case
    out = run(fn, case, q13, q2)
    unit = UNIT[torch.bfloat16] if T * K > min(4 * E, 256) else 0.0
    check_experts(out, *reference_experts(x, f13, f2, ids, weights, emap, weight_unit=unit))


@pytest.mark.parametrize("qtype", [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K],
                         ids=NAMES.get)
@pytest.mark.parametrize("T", [DECODE_T, PREFILL_T])
def test_each_type(emulated, qtype, T):
    check(emulated, T, qtype, qtype, seed=qtype + T)


@pytest.mark.parametrize("q13,q2", [(Q4_K, Q6_K), (Q8_0, Q4_1), (Q5_1, Q5_0)],
                         ids=lambda q: NAMES[q])
@pytest.mark.parametrize("T", [DECODE_T, PREFILL_T])
def test_mixed_types_and_spare_slots(emulated, q13, q2, T):
    check(emulated, T, q13, q2, slots=7, seed=T)


def test_a_wrong_decode_fails_the_check(emulated):
    """The check can fail: the down experts read with the wrong type's layout are far off."""
    case = make_case(DECODE_T, Q4_K, Q5_K, E, 1)
    x, (_, f13), (_, f2), ids, weights, emap = case
    out = run(emulated, case, Q4_K, Q4_K)     # Q5_K rows (176 bytes a block) as Q4_K (144)
    with pytest.raises(AssertionError):
        check_experts(out, *reference_experts(x, f13, f2, ids, weights, emap))
