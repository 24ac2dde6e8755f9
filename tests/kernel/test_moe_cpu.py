"""cpu-x86_64 MoE kernels (routing; routed experts over f32 weights and GGUF rows) against a
numpy float64 reference of the kernel contract, through the real loader path.

Expert outputs are checked element-wise against a worst-case error bound propagated from f32
accumulation (n * u * sum |w x| for a dot product of length n) and, for GGUF rows, from the
kernels' int8 activation rounding (at most half a step, step = block max / 127, per element);
quantized results must also stay within 4x the RMS error that independent rounding predicts.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function

U = 2.0 ** -24                  # unit roundoff of float32
SILU_LIPSCHITZ = 1.1            # max |silu'(g)| = 1.0998
F32, F16, BF16, Q4_0, Q4_1, Q8_0 = 0, 1, 30, 2, 3, 8
QUANTIZED = (Q4_0, Q4_1, Q8_0)
ISAS = ("scalar", "avx2", "avx512")
NO_WORKSPACE = torch.empty(0, dtype=torch.uint8)

# T tokens, E experts, K per token, H hidden, I intermediate, how experts map to slots,
# whether a token may pick one expert twice. H and I are multiples of 32 (GGUF blocks).
CASES = [
    (1, 8, 2, 96, 160, "identity", False),
    (1, 64, 8, 224, 96, "permuted", False),     # decode at top-8, slots out of order
    (3, 4, 4, 160, 32, "shared", False),        # K = E; several experts share a slot
    (3, 6, 3, 96, 64, "identity", True),        # a token routed to one expert twice
    (17, 16, 4, 96, 224, "permuted", False),    # spare slots (S > E)
    (64, 60, 6, 128, 96, "identity", False),
    (64, 32, 8, 32, 64, "shared", True),
    (5, 4, 1, 32, 96, "permuted", False),       # top-1
]
QUANT_CASES = [CASES[i] for i in (1, 3, 5, 6, 7)]


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def make_routing(t, e, k, kind, repeated, seed):
    """(topk_ids int32 [T, K], topk_weights f32 [T, K], expert_map int32 [E], slots S)."""
    g = rng(seed)
    if repeated:
        ids = g.integers(0, e, size=(t, k))
        ids[:, 1] = ids[:, 0]
    else:
        ids = np.stack([g.permutation(e)[:k] for _ in range(t)])
    weights = g.uniform(0.05, 1.0, size=(t, k)).astype(np.float32)
    if kind == "identity":
        slots, emap = e, np.arange(e)
    elif kind == "permuted":
        slots = e + 3
        emap = g.permutation(slots)[:e]
    else:
        slots = max(1, e // 2)
        emap = g.integers(0, slots, size=e)
    return ids.astype(np.int32), weights, emap.astype(np.int32), slots


def make_weights(s, h, i, seed):
    g = rng(seed)
    w13 = (g.standard_normal((s, 2 * i, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (g.standard_normal((s, h, i)) / np.sqrt(i)).astype(np.float32)
    return w13, w2


def to_rows(w: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF bytes uint8 [S, rows, row_bytes] of w, and the float64 weights they hold."""
    t = gguf.GGMLQuantizationType(qtype)
    blocks = np.ascontiguousarray(gguf.quants.quantize(w, t))
    held = gguf.quants.dequantize(blocks, t).astype(np.float64)
    return blocks.view(np.uint8).reshape(w.shape[0], w.shape[1], -1), held


# ------------------------------------------------------------------ float64 reference

def silu(v):
    return v / (1.0 + np.exp(-v))


def half_steps(v: np.ndarray) -> np.ndarray:
    """Half the int8 step of each element's 32-block: the most its rounding moves it."""
    blocks = v.reshape(v.shape[0], -1, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127.0
    return np.broadcast_to(step / 2, blocks.shape).reshape(v.shape)


def dot_bound(v_abs, w, n):
    """f32 rounding of the rows of v . the rows of w over n terms: n * u * |v| |w|^T."""
    return n * U * (v_abs @ np.abs(w).T)


def expert_reference(xs, w13, w2, q13, q2):
    """y [P, H] for rows xs [P, H] through one expert, with a worst-case bound and the RMS
    variance of the kernel's error (int8 rounding of x when q13, of act when q2)."""
    i = w2.shape[1]
    wg, wu = w13[:i], w13[i:]
    hx = half_steps(xs) if q13 else np.zeros_like(xs)
    xa = np.abs(xs) + hx
    g, u = xs @ wg.T, xs @ wu.T
    dg = dot_bound(xa, wg, xs.shape[1]) + hx @ np.abs(wg).T
    du = dot_bound(xa, wu, xs.shape[1]) + hx @ np.abs(wu).T
    sg = silu(g)
    a = sg * u
    da = (SILU_LIPSCHITZ * dg * (np.abs(u) + du) + (np.abs(sg) + SILU_LIPSCHITZ * dg) * du
          + 8 * U * np.abs(a))                       # exp8 is within 2e-7 relative
    ha = half_steps(np.abs(a) + da) if q2 else np.zeros_like(a)
    y = a @ w2.T
    dy = (da + ha) @ np.abs(w2).T + dot_bound(np.abs(a) + da + ha, w2, i)
    sig = 1.0 / (1.0 + np.exp(-g))
    dsilu = sig * (1.0 + g * (1.0 - sig))
    vg = (hx ** 2 / 3) @ (wg ** 2).T                  # uniform in +-half step: var = half^2 / 3
    vu = (hx ** 2 / 3) @ (wu ** 2).T
    va = (dsilu * u) ** 2 * vg + sg ** 2 * vu
    vy = va @ (w2 ** 2).T + ((half_steps(a) ** 2 / 3) @ (w2 ** 2).T if q2 else 0.0)
    return y, dy, vy


def moe_reference(x, w13, w2, ids, weights, emap, q13=False, q2=False):
    """(out, bound, variance) float64 [T, H] of the contract:
    out[t] = sum_k w[t,k] * (w2[s] @ (silu(w13[s,:I] @ x[t]) * (w13[s,I:] @ x[t]))), s = emap[id]."""
    x = x.astype(np.float64)
    out, bound, var, mag = (np.zeros_like(x) for _ in range(4))
    slots = emap[ids]
    for s in np.unique(slots):
        tok, kk = np.nonzero(slots == s)
        y, dy, vy = expert_reference(x[tok], w13[s], w2[s], q13, q2)
        wt = weights[tok, kk].astype(np.float64)[:, None]
        np.add.at(out, tok, wt * y)
        np.add.at(bound, tok, np.abs(wt) * dy)
        np.add.at(var, tok, wt ** 2 * vy)
        np.add.at(mag, tok, np.abs(wt * y))
    return out, bound + (ids.shape[1] + 2) * U * mag, var


def assert_within(got, want, bound, var=None):
    got = np.asarray(got, dtype=np.float64)
    excess = np.abs(got - want) - bound
    worst = np.unravel_index(excess.argmax(), excess.shape)
    assert excess.max() <= 0, (f"{excess.max():.3g} over the bound at {worst}: got {got[worst]}, "
                               f"want {want[worst]}, bound {bound[worst]:.3g}")
    if var is not None and var.sum() > 0:
        err, rms = np.linalg.norm(got - want), np.sqrt(var.sum())
        assert err <= 4 * rms, f"error norm {err:.3g} vs predicted RMS {rms:.3g}"


# ------------------------------------------------------------------ helpers around the kernels

def run_experts(x, w13, w2, ids, weights, emap, workspace=NO_WORKSPACE):
    out = torch.full(x.shape, float("nan"))          # overwritten, never added to
    ops.moe_experts(out, torch.from_numpy(x), torch.from_numpy(w13), torch.from_numpy(w2),
                    torch.from_numpy(ids), torch.from_numpy(weights), torch.from_numpy(emap),
                    workspace)
    return out.numpy()


def run_quant(x, rows13, rows2, q13, q2, ids, weights, emap, isa=None):
    out = torch.full(x.shape, float("nan"))
    args = (out, torch.from_numpy(x), torch.from_numpy(rows13), torch.from_numpy(rows2), q13, q2,
            torch.from_numpy(ids), torch.from_numpy(weights), torch.from_numpy(emap), NO_WORKSPACE)
    if isa is None:
        ops.moe_experts_quant(*args)
    else:
        get_function("moe", "moe_experts_quant_isa", "cpu")(*args, isa)
    return out.numpy()


def supported_isas() -> tuple[str, ...]:
    return ISAS[: ISAS.index(ops.cpu_isa()) + 1]


def case_inputs(case, seed):
    t, e, k, h, i, kind, repeated = case
    ids, weights, emap, slots = make_routing(t, e, k, kind, repeated, seed)
    w13, w2 = make_weights(slots, h, i, seed + 1)
    x = rng(seed + 2).standard_normal((t, h)).astype(np.float32)
    return x, w13, w2, ids, weights, emap


# ------------------------------------------------------------------ routed experts

@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-E{}-K{}-H{}-I{}-{}{}".format(
    *c[:6], "-repeated" if c[6] else ""))
def test_moe_experts_f32(case):
    x, w13, w2, ids, weights, emap = case_inputs(case, seed=sum(case[:5]))
    got = run_experts(x, w13, w2, ids, weights, emap)
    want, bound, _ = moe_reference(x, w13.astype(np.float64), w2.astype(np.float64), ids, weights, emap)
    assert_within(got, want, bound)


QTYPE_PAIRS = [(Q8_0, Q8_0), (Q4_0, Q4_1), (Q4_1, Q8_0), (F16, Q4_0), (BF16, F32), (F32, F16)]


@pytest.mark.parametrize("q13,q2", QTYPE_PAIRS)
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-K{c[2]}")
def test_moe_experts_quant(case, q13, q2):
    x, w13, w2, ids, weights, emap = case_inputs(case, seed=sum(case[:5]) + q13 + 7 * q2)
    rows13, held13 = to_rows(w13, q13)
    rows2, held2 = to_rows(w2, q2)
    got = run_quant(x, rows13, rows2, q13, q2, ids, weights, emap)
    want, bound, var = moe_reference(x, held13, held2, ids, weights, emap,
                                     q13 in QUANTIZED, q2 in QUANTIZED)
    assert_within(got, want, bound, var)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("q13,q2", [(Q4_1, Q8_0), (Q8_0, Q4_0), (F16, BF16), (F32, F32)])
def test_moe_experts_each_isa(isa, q13, q2):
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    case = (17, 16, 4, 96, 224, "permuted", True)
    x, w13, w2, ids, weights, emap = case_inputs(case, seed=5)
    rows13, held13 = to_rows(w13, q13)
    rows2, held2 = to_rows(w2, q2)
    got = run_quant(x, rows13, rows2, q13, q2, ids, weights, emap, isa=isa)
    want, bound, var = moe_reference(x, held13, held2, ids, weights, emap,
                                     q13 in QUANTIZED, q2 in QUANTIZED)
    assert_within(got, want, bound, var)


def test_moe_experts_threads_workspace_and_numpy_inputs_do_not_change_results():
    x, w13, w2, ids, weights, emap = case_inputs((64, 32, 8, 96, 64, "permuted", False), seed=11)
    set_threads = get_function("quant_gemm", "set_num_threads", "cpu")  # the shared pool
    try:
        assert set_threads(1) == 1
        single = run_experts(x, w13, w2, ids, weights, emap)
        rows13, _ = to_rows(w13, Q4_1)
        rows2, _ = to_rows(w2, Q8_0)
        single_q = run_quant(x, rows13, rows2, Q4_1, Q8_0, ids, weights, emap)
    finally:
        set_threads(0)
    assert np.array_equal(single, run_experts(x, w13, w2, ids, weights, emap))
    assert np.array_equal(single_q, run_quant(x, rows13, rows2, Q4_1, Q8_0, ids, weights, emap))
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    assert np.array_equal(single, run_experts(x, w13, w2, ids, weights, emap, workspace=big))
    out = np.full(x.shape, np.nan, dtype=np.float32)  # the CPU model passes numpy arrays
    ops.moe_experts(out, x, w13, w2, ids, weights, emap, np.empty(0, dtype=np.uint8))
    assert np.array_equal(single, out)


def test_moe_experts_empty_batch_and_zero_top_k():
    x, w13, w2, ids, weights, emap = case_inputs((3, 4, 2, 32, 32, "identity", False), seed=3)
    none = np.empty((0, 32), dtype=np.float32)
    assert run_experts(none, w13, w2, ids[:0], weights[:0], emap).shape == (0, 32)
    zeros = run_experts(x, w13, w2, ids[:, :0].copy(), weights[:, :0].copy(), emap)
    assert np.array_equal(zeros, np.zeros_like(x))


# ------------------------------------------------------------------ routing

def routing_reference(logits: np.ndarray, k: int, renormalize: bool):
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]    # ties: lower expert first
    w = np.take_along_axis(p, ids, -1)
    if renormalize:
        w /= w.sum(-1, keepdims=True)
    return w, ids


def run_routing(logits: torch.Tensor, k: int, renormalize: bool):
    w = torch.full((logits.shape[0], k), float("nan"))
    ids = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    ops.moe_topk_softmax(w, ids, logits, renormalize)
    return w.numpy(), ids.numpy()


def routing_bound(logits: np.ndarray, want: np.ndarray, e: int, k: int) -> np.ndarray:
    """f32 softmax: exp of (l - max) off by u * |l - max| relative, a sum of E terms, a division
    and K more for renormalising."""
    spread = (logits.max(-1) - logits.min(-1))[:, None].astype(np.float64)
    return 2 * (e + k + 4 + spread) * U * want


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("e,k", [(4, 1), (8, 2), (60, 4), (64, 8), (128, 8)])
@pytest.mark.parametrize("t", [1, 3, 17, 64])
def test_moe_topk_softmax(t, e, k, renormalize):
    logits = torch.from_numpy((rng(t * e + k).standard_normal((t, e)) * 2).astype(np.float32))
    got_w, got_ids = run_routing(logits, k, renormalize)
    want_w, want_ids = routing_reference(logits.numpy(), k, renormalize)
    np.testing.assert_array_equal(got_ids, want_ids)
    assert np.all(np.abs(got_w - want_w) <= routing_bound(logits.numpy(), want_w, e, k))


def test_moe_topk_softmax_ties_pick_the_lower_expert():
    logits = torch.tensor([[0.0] * 6,
                           [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],
                           [2.0, 1.0, 1.0, 1.0, 0.0, 1.0]])
    for renormalize in (True, False):
        got_w, got_ids = run_routing(logits, 3, renormalize)
        want_w, want_ids = routing_reference(logits.numpy(), 3, renormalize)
        np.testing.assert_array_equal(got_ids, [[0, 1, 2], [1, 2, 4], [0, 1, 2]])
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_w, want_w, rtol=32 * U)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_topk_softmax_half_logits(dtype):
    logits = torch.from_numpy(rng(9).standard_normal((5, 16)).astype(np.float32)).to(dtype)
    got_w, got_ids = run_routing(logits, 4, True)
    as_f32 = logits.float().numpy()                    # the kernel computes on these values
    want_w, want_ids = routing_reference(as_f32, 4, True)
    np.testing.assert_array_equal(got_ids, want_ids)
    assert np.all(np.abs(got_w - want_w) <= routing_bound(as_f32, want_w, 16, 4))


# ------------------------------------------------------------------ bad arguments

def raises(match):
    return pytest.raises(RuntimeError, match=match)


def test_bad_expert_arguments_raise_naming_the_argument():
    x, w13, w2, ids, weights, emap = case_inputs((3, 4, 2, 64, 32, "identity", False), seed=1)
    t = torch.from_numpy
    good = dict(out=torch.empty(3, 64), x=t(x), w13=t(w13), w2=t(w2), topk_ids=t(ids),
                topk_weights=t(weights), expert_map=t(emap), workspace=NO_WORKSPACE)
    bad_ids = ids.copy()
    bad_ids[1, 1] = 4
    bad_map = emap.copy()
    bad_map[2] = -1
    cases = [
        (dict(topk_ids=t(bad_ids)), r"topk_ids\[1, 1\] = 4 is outside the E=4 experts"),
        (dict(expert_map=t(bad_map)), r"expert_map\[2\] = -1 is outside the S=4 expert slots"),
        (dict(w13=t(w13[:, :, :32].copy())), r"w13 must be \[S, 2I, H\] = \[4, 64, 64\], got \[4, 64, 32\]"),
        (dict(w2=t(w2[:3].copy())), r"w2 must be \[S, H, I\] = \[4, 64, 32\], got \[3, 64, 32\]"),
        (dict(w13=t(w13[:, :63].copy())), r"w13 must be \[S, 2I, H\] \(gate rows, then up rows\)"),
        (dict(x=t(x).half()), "x must be float32, got float16"),
        (dict(out=torch.empty(2, 64)), r"out must be \[T=3, H=64\] like x, got \[2, 64\]"),
        (dict(topk_weights=t(weights[:, :1].copy())), r"topk_weights must be \[T=3, K=2\]"),
        (dict(topk_ids=t(ids).long()), "topk_ids must be int32, got int64"),
        (dict(topk_ids=t(ids[:2].copy())), r"topk_ids must be \[T=3, K\], got \[2, 2\]"),
        (dict(expert_map=t(emap)[None]), r"expert_map must be \[E\] with E >= 1, got \[1, 4\]"),
        (dict(x=t(x)[:, ::2]), "x must be contiguous"),
    ]
    for change, match in cases:
        with raises(match):
            ops.moe_experts(**{**good, **change})


def test_bad_quant_and_routing_arguments_raise():
    x, w13, w2, ids, weights, emap = case_inputs((3, 4, 2, 64, 48, "identity", False), seed=2)
    rows13, _ = to_rows(w13, Q8_0)
    rows2, _ = to_rows(w2, F16)
    t = torch.from_numpy
    args = [torch.empty(3, 64), t(x), t(rows13), t(rows2), Q8_0, F16, t(ids), t(weights), t(emap),
            NO_WORKSPACE]
    ops.moe_experts_quant(*args)                     # I = 48 is fine for F16 down rows
    with raises(r"qtype13 = 10 is not supported: use F32 \(0\), F16 \(1\), BF16 \(30\)"):
        ops.moe_experts_quant(*args[:4], 10, *args[5:])     # Q2_K: not read on the CPU
    with raises(r"w2 must be \[S, H, I\] = \[4, 64, 96\] \(F16 rows of 48 weights\), got \[4, 64, 34\]"):
        ops.moe_experts_quant(*args[:3], t(to_rows(w2[..., :32].copy(), Q8_0)[0]), *args[4:])
    with raises("w2 rows hold 48 weights, not a multiple of 32 as Q4_0 blocks need"):
        ops.moe_experts_quant(*args[:5], Q4_0, *args[6:])
    with raises("w13 must be uint8"):
        ops.moe_experts_quant(args[0], args[1], t(w13), *args[3:])
    with raises("isa 'sse9'|unknown isa 'sse9'"):
        get_function("moe", "moe_experts_quant_isa", "cpu")(*args, "sse9")
    w, i = torch.empty(3, 5), torch.empty(3, 5, dtype=torch.int32)
    with raises(r"top-k K=5 \(topk_ids' last dim\) must be in \[1, E=4\]"):
        ops.moe_topk_softmax(w, i, torch.randn(3, 4), True)
    with raises("logits must be float32, bfloat16 or float16, got int32"):
        ops.moe_topk_softmax(w[:, :2], i[:, :2], torch.zeros(3, 4, dtype=torch.int32), True)
    with raises(r"topk_weights must be \[T=3, K=2\] like topk_ids, got \[3, 5\]"):
        ops.moe_topk_softmax(w, i[:, :2].contiguous(), torch.randn(3, 4), True)


@pytest.mark.parametrize("q13,q2,inter", [(12, 14, 256), (Q8_0, 6, 96)],
                         ids=["Q4_K-Q6_K", "Q8_0-Q5_0"])
def test_moe_experts_quant_reads_rows_padded_to_16_bytes(q13, q2, inter):
    """GGUF rows as the GPU keeps them (each padded to whole 16-byte words: Q6_K rows of 256
    weights are 210 bytes, Q5_0 rows of 96 are 66), as an expert offload's host blocks are: the
    same result as the file's rows, bit for bit."""
    from freetoken.models.checkpoint.weights import gpu_rows
    from tests.kernel.gguf_random import random_blocks

    r, experts, hidden = rng(11), 4, 256
    b13 = np.stack([random_blocks(q13, 2 * inter, hidden, r, centered=True)
                    for _ in range(experts)])
    b2 = np.stack([random_blocks(q2, hidden, inter, r, centered=True) for _ in range(experts)])
    p13, p2 = gpu_rows(b13), gpu_rows(b2)
    assert p2.shape[-1] > b2.shape[-1]
    ids = np.array([[0, 2], [1, 3], [2, 1]], dtype=np.int32)
    weights = np.array([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]], dtype=np.float32)
    emap = np.arange(experts, dtype=np.int32)
    x = r.standard_normal((3, hidden)).astype(np.float32)
    plain = run_quant(x, b13, b2, q13, q2, ids, weights, emap)
    padded = run_quant(x, np.ascontiguousarray(p13), np.ascontiguousarray(p2), q13, q2, ids,
                       weights, emap)
    assert np.isfinite(plain).all() and np.array_equal(plain, padded)
