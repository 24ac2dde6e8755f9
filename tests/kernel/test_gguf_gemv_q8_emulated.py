"""The int8-activation decode GEMV runs on the host: the real kernels of
kernels/cuda/gguf_gemv_q8.cu (Q4_K straight from memory, the other types staged) built with g++
against the stand-in for the CUDA vocabulary (tests/kernel/emu/freetoken/cuda_common.cuh: one
CPU thread per GPU thread, barriers for __syncthreads, __syncwarp and the warp sums, aborts on
misaligned vector accesses), launched through the kernel's own dispatch by
tests/kernel/gguf_gemv_q8_emu.cc. Evidence without a GPU for the index math (which quants,
scales and x groups meet), every type, rows-per-warp and token instantiation, the norm prologue
and the three epilogues.

The reference is independent of the kernel: gguf's numpy dequantizer for the weights,
kernel/reference.py's rms_norm for the normed input, and the activation quantization the kernel
documents (per 32 values: d = amax / 127, q = rint(x * 127 / amax)) restated in numpy float32,
then a float64 product."""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch

from freetoken.kernel import reference
from tests.kernel.emulation import assert_bf16_within, build_emulation
from tests.kernel.gguf_random import dequantize, random_blocks
from tests.tolerances import EPS

BF16 = torch.bfloat16
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q4_K: "Q4_K",
         Q5_K: "Q5_K", Q6_K: "Q6_K"}
ULPS = 32  # f32 ulps of the sum's magnitude per sqrt(K), as test_decode_gemv_emulated.py
STORE, ADD, SWIGLU = 0, 1, 2


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build_emulation(tmp_path_factory, "gguf_gemv_q8_emu", ctypes.c_int,
                           [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4
                           + [ctypes.c_long] * 2 + [ctypes.c_int] + [ctypes.c_long] * 2
                           + [ctypes.c_int] * 3 + [ctypes.c_float])


def _ptr(t):
    return None if t is None else t.data_ptr()


def padded(blocks: np.ndarray) -> np.ndarray:
    """GGUF rows as the GPU keeps them: padded with zeros to whole 16-byte words."""
    pad = -blocks.shape[-1] % 16
    if not pad:
        return blocks
    return np.ascontiguousarray(np.pad(blocks, [(0, 0)] * (blocks.ndim - 1) + [(0, pad)]))


def _run(fn, out, x, blocks, bias=None, norm=None, mode=STORE, rows=0, eps=1e-6, qtype=Q4_K):
    t, k = x.shape
    n = out.shape[1]
    blocks = padded(blocks)
    ok = fn(_ptr(out), int(out.dtype == torch.float32), _ptr(x), blocks.ctypes.data,
            _ptr(bias), _ptr(norm), x.stride(0), out.stride(0), t, n, k, qtype, mode, rows, eps)
    assert ok, "the configuration was refused"


def quantize_rows(x: torch.Tensor) -> np.ndarray:
    """The kernel's int8 activations, dequantized (float64 [T, K]): groups of 32 in float32."""
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=2, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(v * inv)                       # float32 product, round half to even
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape[0], -1)


def _case(t, rows, k, seed, qtype=Q4_K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k + 8, generator=g).to(BF16)[:, :k]     # strided, 16-byte aligned rows
    blocks = random_blocks(qtype, rows, k, np.random.default_rng(seed))
    w = dequantize(blocks, qtype).astype(np.float64)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(BF16)
    return x, blocks, w, nw, g


def _normed(x, nw, norm):
    if not norm:
        return x
    xn = torch.empty_like(x)
    reference.rms_norm(xn, x, nw, 1e-6)
    return xn


def offset_terms(blocks: np.ndarray, qtype: int = Q4_K) -> np.ndarray:
    """The part of every weight (float64 [rows, K]) that the kernel sums apart from its scaled
    quant, so that the two may cancel in float32: |dmin * m_s| (Q4_K, Q5_K), |8 d| (Q4_0),
    |16 d| (Q5_0), |m| (Q4_1, Q5_1); none for Q8_0 and Q6_K, whose offsets are taken in
    integers. Read from the bytes."""
    rows = blocks.shape[0]
    # block bytes, the f16 field of the offset, and what multiplies it: -8 d (Q4_0), -16 d
    # (Q5_0), m (Q4_1, Q5_1)
    small = {Q4_0: (18, 0, 8), Q4_1: (20, 2, 1), Q5_0: (22, 0, 16), Q5_1: (24, 2, 1)}
    if qtype in small:
        size, field, times = small[qtype]
        b = blocks.reshape(rows, -1, size)
        v = np.abs(b[:, :, field:field + 2].copy().view(np.float16)[..., 0].astype(np.float64))
        return np.repeat(v * times, 32, axis=1)
    if qtype not in (Q4_K, Q5_K):
        return np.zeros((rows, blocks.shape[1] // {Q8_0: 34, Q6_K: 210}[qtype]
                         * {Q8_0: 32, Q6_K: 256}[qtype]))
    b = blocks.reshape(rows, -1, 144 if qtype == Q4_K else 176)
    dmin = b[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    sc = b[:, :, 4:16].astype(np.int64)
    m = np.empty(sc.shape[:2] + (8,), dtype=np.int64)
    m[..., :4] = sc[..., 4:8] & 63
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return np.repeat(np.abs(dmin[..., None] * m), 32, axis=2).reshape(rows, -1)


def q8_bound(xn: torch.Tensor, xq: np.ndarray, w: np.ndarray, blocks: np.ndarray,
             norm: bool, qtype: int = Q4_K) -> np.ndarray:
    """f32 rounding of the scaled integer sums: magnitude the root-sum-square of the products,
    each weight counted as its quant part plus its offset part (the two may cancel); plus, with
    the norm, a few normed elements whose bf16 rounding flips between two float32 orders (each
    moves one int8 step of its group)."""
    k = w.shape[1]
    parts = np.abs(w) + 2 * offset_terms(blocks, qtype)
    rss = np.sqrt((xq ** 2) @ (parts ** 2).T)
    order = ULPS * EPS["float32"] * rss * math.sqrt(k)
    flips = 0.0
    if norm:
        top = float(xn.float().abs().max())
        flips = 4 * (top / 127 + EPS["bfloat16"] * top) * np.abs(w).max()
    return order + flips


# (tokens, N, K). Q4_K: one partial round of units (K = 256: 8 of 32 lanes), one whole round
# (4096), a partial last round (2560) and several rounds (12288 at 2 tokens: the staging
# capacity); rows of up to 2048 weights (the short-row kernel: 2048 fills its one round); 3-8
# tokens (the 4- and 8-token kernels, 3 and 5 with masked tokens; 8 x 4096 fills the staging).
# The staged types: K = 2048 (Q6_K's shortest row of whole 16-byte words), one or two chunks,
# and several (12288 at 2 tokens, their staging capacity); Q6_K and Q8_0 at 3-8 tokens too
# (8 x 3072: the staging).
SHAPES = {Q4_K: [(1, 37, 256), (1, 21, 2048), (1, 21, 4096), (2, 19, 2560), (2, 9, 12288),
                 (3, 19, 2048), (5, 11, 1024), (8, 7, 4096)],
          "staged": [(1, 37, 2048), (1, 21, 4096), (2, 19, 6144), (2, 9, 12288)],
          "eight": [(3, 9, 2048), (8, 7, 3072)]}
STORE_CASES = ([(Q4_K, *shape, rows) for shape in SHAPES[Q4_K] for rows in (0, 1, 2)]
               + [(qt, *shape, 0) for qt in TYPES if qt != Q4_K for shape in SHAPES["staged"]]
               + [(qt, *shape, 0) for qt in (Q6_K, Q8_0) for shape in SHAPES["eight"]])


@pytest.mark.parametrize("qtype,t,n,k,rows", STORE_CASES,
                         ids=[f"{TYPES[c[0]]}-{c[1]}x{c[3]}-r{c[4]}" for c in STORE_CASES])
@pytest.mark.parametrize("norm", (False, True), ids=("x", "normed"))
def test_store_matches_the_quantized_product(emulated, qtype, t, n, k, rows, norm):
    x, blocks, w, nw, g = _case(t, n, k, seed=n + k + rows + qtype, qtype=qtype)
    bias = torch.randn(n, generator=g).to(BF16)
    xn = _normed(x, nw, norm)
    xq = quantize_rows(xn)
    for out_dtype, with_bias in ((torch.float32, False), (BF16, True)):
        whole = torch.full((t, n + 5), float("nan"), dtype=out_dtype)
        out = whole[:, 2:2 + n]                       # a column slice
        _run(emulated, out, x, blocks, bias if with_bias else None, nw if norm else None,
             STORE, rows, qtype=qtype)
        want = xq @ w.T + (bias.double().numpy() if with_bias else 0.0)
        assert_bf16_within(out, want, q8_bound(xn, xq, w, blocks, norm, qtype),
               f"out {out_dtype} bias={with_bias}")
        assert torch.isnan(whole[:, :2]).all() and torch.isnan(whole[:, 2 + n:]).all()


def test_int8_activations_stay_within_their_rounding(emulated):
    """Against the unquantized product: each x moves by at most half its group's step."""
    x, blocks, w, nw, _ = _case(1, 33, 4096, seed=3)
    out = torch.empty(1, 33, dtype=torch.float32)
    _run(emulated, out, x, blocks)
    xf = x.double().numpy()
    step = np.abs(xf).reshape(1, -1, 32).max(axis=2, keepdims=True) / 127
    half_step = np.broadcast_to(step / 2, (1, 128, 32)).reshape(1, -1)
    bound = half_step @ np.abs(w).T + q8_bound(x, xf, w, blocks, False)
    assert_bf16_within(out, xf @ w.T, bound, "vs the bf16 activations")


@pytest.mark.parametrize("qtype,t,n,k,rows", [(Q4_K, 1, 17, 4096, 0), (Q4_K, 2, 12, 2560, 1),
                                              (Q4_K, 2, 7, 512, 2), (Q6_K, 1, 17, 12288, 0),
                                              (Q5_K, 2, 12, 4096, 0),
                                              (Q6_K, 2, 9, 768, 0),    # padded rows
                                              (Q4_K, 8, 11, 2048, 0), (Q6_K, 5, 9, 2048, 0)])
def test_residual_add(emulated, qtype, t, n, k, rows):
    x, blocks, w, _, g = _case(t, n, k, seed=7 * n + rows, qtype=qtype)
    residual = torch.randn(t, n, generator=g).to(BF16)
    xq = quantize_rows(x)
    prod = xq @ w.T
    out = residual.clone()
    _run(emulated, out, x, blocks, mode=ADD, rows=rows, qtype=qtype)
    # the product is rounded to bf16, then the sum: one bf16 ulp of each on top of the order
    want = residual.double().numpy() + prod
    bound = (q8_bound(x, xq, w, blocks, False, qtype)
             + 2 * EPS["bfloat16"] * (np.abs(prod) + np.abs(want)))
    assert_bf16_within(out, want, bound, "residual add")


@pytest.mark.parametrize("qtype,t,inter,k,rows,norm", [
    (Q4_K, 1, 20, 4096, 0, True), (Q4_K, 2, 13, 2560, 2, False), (Q4_K, 1, 9, 512, 1, True),
    (Q8_0, 1, 20, 4096, 0, True), (Q4_0, 2, 9, 2048, 0, False), (Q4_K, 6, 9, 2048, 0, True),
    (Q8_0, 3, 7, 1024, 0, True)])
def test_swiglu(emulated, qtype, t, inter, k, rows, norm):
    x, blocks, w, nw, _ = _case(t, 2 * inter, k, seed=inter + k, qtype=qtype)
    xn = _normed(x, nw, norm)
    xq = quantize_rows(xn)
    gu = xq @ w.T
    gate, up = gu[:, :inter], gu[:, inter:]
    silu = gate / (1 + np.exp(-gate))
    want = silu * up
    out = torch.full((t, inter), float("nan"), dtype=BF16)
    _run(emulated, out, x, blocks, norm=nw if norm else None, mode=SWIGLU, rows=rows,
         qtype=qtype)
    # g and u within the dot bound and their bf16 rounding
    lim = q8_bound(xn, xq, w, blocks, norm, qtype) + 2 * EPS["bfloat16"] * np.abs(gu)
    lg, lu = lim[:, :inter], lim[:, inter:]
    bound = 1.1 * lg * np.abs(up) + np.abs(silu) * lu + lg * lu
    assert_bf16_within(out, want, bound, "swiglu")


def test_refuses_what_the_entry_point_refuses(emulated):
    x, blocks, _, _, _ = _case(1, 8, 256, seed=0)
    out = torch.zeros(1, 8, dtype=BF16)
    args = (_ptr(out), 0, _ptr(x), blocks.ctypes.data, None, None, x.stride(0), 8)
    assert emulated(*args, 1, 8, 256, Q4_K, STORE, 0, 1e-6)
    assert not emulated(*args, 9, 8, 256, Q4_K, STORE, 0, 1e-6)          # 1-8 tokens: Q4_K,
    assert not emulated(*args, 3, 8, 256, Q4_0, STORE, 0, 1e-6)          # Q6_K, Q8_0; else 1-2
    assert not emulated(*args, 1, 8, 32768 + 256, Q4_K, STORE, 0, 1e-6)  # past the staging
    assert not emulated(*args, 1, 8, 24576 + 2048, Q6_K, STORE, 0, 1e-6)  # (staged: less room)
    assert not emulated(*args, 1, 8, 200, Q4_K, STORE, 0, 1e-6)          # not whole blocks
    assert not emulated(*args, 1, 8, 256, 10, STORE, 0, 1e-6)            # Q2_K: not read
    assert not emulated(*args, 1, 8, 256, Q4_K, STORE, 3, 1e-6)          # rows per warp
    f32 = torch.zeros(1, 8, dtype=torch.float32)
    assert not emulated(_ptr(f32), 1, *args[2:], 1, 8, 256, Q4_K, ADD, 0, 1e-6)


# ---------------------------------------------------------------- the MoE decode halves

@pytest.fixture(scope="module")
def emulated_moe(tmp_path_factory):
    return build_emulation(tmp_path_factory, "gguf_gemv_q8_emu", ctypes.c_int,
                           [ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_long] * 3
                           + [ctypes.c_int] * 4 + [ctypes.c_long] * 2, entry="moe_q8_emu")


# Six experts over five slots, expert 3 unmapped (its pairs add nothing), and routes that two
# tokens share (expert 1), as offload maps and real routers give them.
EXPERT_MAP = np.array([4, 0, 2, -1, 1, 3], dtype=np.int32)
IDS = np.array([[1, 3, 5], [0, 1, 4], [5, 2, 1]], dtype=np.int32)
# (gate/up type, down type, H, I): the Q4_K_M mix (Q6_K down rows of 630 bytes padded to 640,
# I = 768 as Qwen3-30B-A3B's), all Q4_K (short rows both halves; gate/up rows past 2048), and
# staged gate/up rows (Q6_K: 420 bytes padded).
MOE_CASES = [(Q4_K, Q6_K, 512, 768), (Q4_K, Q4_K, 512, 512), (Q4_K, Q4_K, 2304, 256),
             (Q8_0, Q8_0, 256, 128), (Q8_0, Q8_0, 256, 64),
             (Q5_1, Q5_0, 256, 128),
             (Q6_K, Q5_K, 512, 256)]


def _expert_floats(blocks: np.ndarray, qtype: int) -> np.ndarray:
    return np.stack([dequantize(b, qtype).astype(np.float64) for b in blocks])


def moe_case(q13, q2, h, inter, tokens):
    """(x, padded w13 and w2 blocks, their unpadded blocks, ids, routing weights) of a case."""
    rng, g = np.random.default_rng(q13 * 31 + q2 + h), torch.Generator().manual_seed(inter)
    slots, k = 5, IDS.shape[1]
    ids, wts = IDS[:tokens].copy(), rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    b13 = np.stack([random_blocks(q13, 2 * inter, h, rng) for _ in range(slots)])
    b2 = np.stack([random_blocks(q2, h, inter, rng) for _ in range(slots)])
    x = torch.randn(tokens, h, generator=g).to(BF16)
    return x, padded(b13), padded(b2), b13, b2, ids, wts


def check_moe(act, out, x, b13, b2, q13, q2, ids, wts, residual=None, emap=EXPERT_MAP):
    """act (bf16 [T * K, I]) and out (bf16 [T, H], after residual when given) of the two MoE
    halves against gguf's dequantized experts and the documented int8 activations; the down
    half from the kernel's own act, so the halves are checked apart."""
    tokens, k = ids.shape
    inter = act.shape[1]
    w13, w2 = _expert_floats(b13, q13), _expert_floats(b2, q2)
    xq = quantize_rows(x)
    got_act = act.double().numpy()
    aq = quantize_rows(act)
    want = residual.double().numpy().copy() if residual is not None else np.zeros(out.shape)
    bound = np.zeros(out.shape)
    for p in range(tokens * k):
        t, slot = p // k, emap[ids[p // k, p % k]]
        if slot < 0:
            assert (got_act[p] == 0).all(), "an unmapped pair's act is zeros"
            continue
        gu = xq[t] @ w13[slot].T
        gate, up = gu[:inter], gu[inter:]
        silu = gate / (1 + np.exp(-gate))
        lim = (q8_bound(x[t:t + 1], xq[t:t + 1], w13[slot], b13[slot], False, q13)[0]
               + 2 * EPS["bfloat16"] * np.abs(gu))
        lg, lu = lim[:inter], lim[inter:]
        assert_bf16_within(act[p:p + 1], (silu * up)[None],
                           (1.1 * lg * np.abs(up) + np.abs(silu) * lu + lg * lu)[None],
                           f"act of pair {p}")
        y = aq[p] @ w2[slot].T
        want[t] += wts[t, p % k] * y
        bound[t] += wts[t, p % k] * (
            q8_bound(act[p:p + 1], aq[p:p + 1], w2[slot], b2[slot], False, q2)[0]
            + 4 * EPS["float32"] * (np.abs(aq[p]) @ np.abs(w2[slot]).T))
    # the routed sum rounded to bf16 (and, accumulating, the sum with the residual once more)
    base = residual.double().numpy() if residual is not None else 0
    bound += 2 * EPS["bfloat16"] * (np.abs(want - base) + np.abs(want))
    assert_bf16_within(out, want, bound, "y")


@pytest.mark.parametrize("q13,q2,h,inter", MOE_CASES,
                         ids=[f"{TYPES[c[0]]}-{TYPES[c[1]]}-{c[2]}x{c[3]}" for c in MOE_CASES])
@pytest.mark.parametrize("tokens", (1, 2, 3))
@pytest.mark.parametrize("accumulate", (False, True), ids=("store", "add"))
@pytest.mark.parametrize("rows", (1, 2), ids=("r1", "r2"))
def test_moe_halves_match_the_quantized_experts(emulated_moe, q13, q2, h, inter, tokens,
                                                accumulate, rows):
    """act[p] = silu(g) * u of pair p's expert, then y_t = sum_k w_k * down_k(act[p]) over the
    token's routed experts (check_moe)."""
    x, p13, p2, b13, b2, ids, wts = moe_case(q13, q2, h, inter, tokens)
    k = ids.shape[1]
    act = torch.full((tokens * k, inter), float("nan"), dtype=BF16)
    whole = torch.randn(tokens, h + 8, generator=torch.Generator().manual_seed(h)).to(BF16)
    out = whole[:, :h]
    residual = out.clone()
    ok = emulated_moe(_ptr(out), _ptr(act), _ptr(x), p13.ctypes.data, p2.ctypes.data,
                      ids.ctypes.data, wts.ctypes.data, EXPERT_MAP.ctypes.data, tokens, k,
                      len(EXPERT_MAP), p13.shape[0], h, inter, whole.stride(0), q13, q2,
                      int(accumulate), rows, 0, 0)
    assert ok, "the configuration was refused"
    check_moe(act, out, x, b13, b2, q13, q2, ids, wts, residual if accumulate else None)
    assert torch.isfinite(whole[:, h:]).all()


@pytest.mark.parametrize("q13,q2,h,inter", [MOE_CASES[0], MOE_CASES[3]],
                         ids=["Q4_K-Q6_K", "Q8_0-Q8_0"])
@pytest.mark.parametrize("tokens", (1, 3))
def test_moe_halves_read_slots_of_an_offload_pool(emulated_moe, q13, q2, h, inter, tokens):
    """An expert-offload pool: each slot holds an expert's gate/up rows then its down rows in
    room for a wider expert (the rest of the slot is 0xFF bytes, never read); both halves read
    the slots `slot_bytes` apart and give what the packed stacks give."""
    x, p13, p2, b13, b2, ids, wts = moe_case(q13, q2, h, inter, tokens)
    slots, k = p13.shape[0], ids.shape[1]
    e13, e2 = p13[0].nbytes, p2[0].nbytes
    slot_bytes = e13 + e2 + 4096
    pool = np.full((slots, slot_bytes), 0xFF, dtype=np.uint8)
    pool[:, :e13] = p13.reshape(slots, -1)
    pool[:, e13:e13 + e2] = p2.reshape(slots, -1)
    act = torch.full((tokens * k, inter), float("nan"), dtype=BF16)
    out = torch.full((tokens, h), float("nan"), dtype=BF16)
    ok = emulated_moe(_ptr(out), _ptr(act), _ptr(x), pool.ctypes.data, pool.ctypes.data + e13,
                      ids.ctypes.data, wts.ctypes.data, EXPERT_MAP.ctypes.data, tokens, k,
                      len(EXPERT_MAP), slots, h, inter, h, q13, q2, 0, 1, slot_bytes,
                      slot_bytes)
    assert ok, "the configuration was refused"
    check_moe(act, out, x, b13, b2, q13, q2, ids, wts)


def test_moe_halves_refuse_what_the_entry_points_refuse(emulated_moe):
    zeros = np.zeros(1 << 20, dtype=np.uint8)
    buf = torch.zeros(4096, dtype=BF16)
    ids = IDS[:1].copy()
    wts = np.ones((1, 3), dtype=np.float32)

    def run(q13, q2, h, inter, tokens=1, k=3, rows=1):
        return emulated_moe(_ptr(buf), _ptr(buf), _ptr(buf), zeros.ctypes.data,
                            zeros.ctypes.data, ids.ctypes.data, wts.ctypes.data,
                            EXPERT_MAP.ctypes.data, tokens, k, 6, 5, h, inter, h, q13, q2, 0,
                            rows, 0, 0)

    assert run(Q8_0, Q8_0, 64, 32)
    assert not run(Q4_K, Q4_K, 256, 128)          # Q4_K down rows of whole 256-weight blocks
    assert not run(Q8_0, Q8_0, 64, 32, k=17)      # top_k <= 16
    assert not run(Q6_K, Q8_0, 24576 + 256, 32)   # x past the staging
    assert not run(Q8_0, Q8_0, 64, 30)            # not whole blocks
    assert not run(Q8_0, Q8_0, 64, 32, rows=3)    # rows per warp: 1 or 2


# Pairs sharing experts as a batch's do: each token's top-8 of 16 experts over 12 slots (experts
# 3 and 9 unmapped), its experts distinct, some experts chosen by far more than 8 pairs.
def _batch_routing(tokens, k=8, experts=16, seed=7):
    rng = np.random.default_rng(seed)
    weight = np.ones(experts)
    weight[[1, 2, 5]] = 3.0
    ids = np.stack([rng.choice(experts, k, replace=False, p=weight / weight.sum())
                    for _ in range(tokens)]).astype(np.int32)
    emap = np.full(experts, -1, dtype=np.int32)
    mapped = [e for e in range(experts) if e not in (3, 9)]
    emap[mapped] = rng.permutation(len(mapped)).astype(np.int32)
    return ids, emap


# (gate/up type, down type, H, I, tokens): 264 pairs over Q4_K's kernels, 136 over the staged
@pytest.mark.parametrize("q13,q2,h,inter,tokens",
                         [(Q4_K, Q4_K, 256, 256, 33), (Q8_0, Q8_0, 256, 64, 17)],
                         ids=["Q4_K", "Q8_0"])
def test_moe_halves_over_a_batchs_routes(emulated_moe, q13, q2, h, inter, tokens):
    """A batch's routes (experts shared by many pairs, some unmapped): a block row per pair,
    then per token, against the experts (check_moe); unmapped pairs' act is zeros."""
    ids, emap = _batch_routing(tokens)
    k = ids.shape[1]
    slots = int(emap.max()) + 1
    rng, g = np.random.default_rng(h + inter), torch.Generator().manual_seed(inter)
    unpadded13 = np.stack([random_blocks(q13, 2 * inter, h, rng) for _ in range(slots)])
    unpadded2 = np.stack([random_blocks(q2, h, inter, rng) for _ in range(slots)])
    p13, p2 = padded(unpadded13), padded(unpadded2)
    x = torch.randn(tokens, h, generator=g).to(BF16)
    wts = np.random.default_rng(tokens).uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    counts = np.bincount(emap[ids.reshape(-1)] + 1)
    assert counts[0] > 0 and counts[1:].max() > 8   # unmapped pairs; experts shared widely
    act = torch.full((tokens * k, inter), float("nan"), dtype=BF16)
    out = torch.full((tokens, h), float("nan"), dtype=BF16)
    assert emulated_moe(_ptr(out), _ptr(act), _ptr(x), p13.ctypes.data, p2.ctypes.data,
                        ids.ctypes.data, wts.ctypes.data, emap.ctypes.data, tokens, k,
                        len(emap), slots, h, inter, h, q13, q2, 0, 1, 0, 0)
    check_moe(act, out, x, unpadded13, unpadded2, q13, q2, ids, wts, emap=emap)
