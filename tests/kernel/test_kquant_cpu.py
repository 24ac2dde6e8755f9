"""GGUF Q5_0/Q5_1 and K-quant (Q4_K, Q5_K, Q6_K) blocks on the CPU: dequantize_rows,
quant_matmul on every ISA this CPU has, and the MoE expert kernel, against the `gguf`
package's numpy dequantizer on random but valid blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function
from tests.kernel import gguf_blocks as gb
from tests.tolerances import assert_close, eps

ISAS = ("scalar", "avx2", "avx512")
NEW_TYPES = (gb.Q5_0, gb.Q5_1, gb.Q4_K, gb.Q5_K, gb.Q6_K)
# (M, K, N): decode, decode long enough to prefetch, prefill tiles of 4 plus remainders
SHAPES = [(1, 256, 8), (1, 512, 300), (3, 768, 13), (6, 256, 21)]


def supported_isas() -> tuple[str, ...]:
    return ISAS[: ISAS.index(ops.cpu_isa()) + 1]


def activation_group(qtype: int) -> int:
    """Weights per int8 activation scale: a super-block for the K-quants, else a 32-block."""
    return 256 if qtype in (gb.Q4_K, gb.Q5_K, gb.Q6_K) else 32


def int8_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers with max |x| = 127 in every 32-block: the kernel's int8 rounding is exact."""
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(seed)).float()
    x.view(m, -1, 32)[:, :, 5] = 127.0
    return x


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_dequantize_rows_matches_gguf_package(qtype):
    rows = gb.random_rows(7, 512, qtype, seed=qtype)
    want = torch.from_numpy(gb.dequantize(rows, qtype))
    ids = torch.tensor([6, 0, 3, 3])
    out = torch.empty(4, 512)
    ops.dequantize_rows(out, ids, torch.from_numpy(rows), qtype)
    # the same products of f16 scales and integers; at most one float32 rounding apart
    assert_close(out, want[ids], torch.float32, magnitude=want.abs().max(), ulps=2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_quant_matmul_each_isa_against_gguf_dequantize(isa, qtype, m, k, n):
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    rows = gb.random_rows(n, k, qtype, seed=m * k + n + qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = int8_activations(m, k, seed=k + qtype)
    out = torch.full((m, n), float("nan"))
    get_function("quant_gemm", "quant_matmul_isa", "cpu")(out, x, torch.from_numpy(rows), qtype,
                                                          isa)
    want = x.double().numpy() @ w.T
    # float32 accumulation over K products of exact integers and f16-derived scales
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, want, torch.float32, magnitude=magnitude, terms=k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", NEW_TYPES + (gb.Q4_0, gb.Q4_1, gb.Q8_0))
def test_quant_matmul_subnormal_f16_scales(isa, qtype):
    """Real Q6_K/Q4_K files hold many subnormal f16 super-block scales: they must convert as
    exactly as normal ones (the SIMD paths convert halves with F16C)."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    m, k, n = 2, 512, 12
    # every f16 value below 2**-20, far under the smallest normal half (2**-14)
    rows = gb.random_rows(n, k, qtype, seed=3 + qtype, half_scale=2.0 ** -20)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = int8_activations(m, k, seed=qtype)
    out = torch.full((m, n), float("nan"))
    get_function("quant_gemm", "quant_matmul_isa", "cpu")(out, x, torch.from_numpy(rows), qtype,
                                                          isa)
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, x.double().numpy() @ w.T, torch.float32, magnitude=magnitude, terms=k)


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_quant_matmul_real_activations_within_int8_rounding(qtype):
    m, k, n = 5, 512, 40
    rows = gb.random_rows(n, k, qtype, seed=11 + qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype))
    out = torch.empty(m, n)
    ops.quant_matmul(out, x, torch.from_numpy(rows), qtype)
    xd = x.double().numpy()
    # each activation is rounded to its group's int8 step (max |x| of the group / 127)
    g = activation_group(qtype)
    step = np.abs(xd.reshape(m, -1, g)).max(-1, keepdims=True) / 127
    quant_bound = np.broadcast_to(step / 2, (m, k // g, g)).reshape(m, k) @ np.abs(w).T
    rounding = 8 * eps(torch.float32) * np.sqrt(k) * (np.abs(xd) @ np.abs(w).T)
    excess = np.abs(out.double().numpy() - xd @ w.T) - (quant_bound + rounding)
    assert excess.max() <= 0, f"worst excess over the int8 rounding bound: {excess.max():.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", (gb.Q4_K, gb.Q5_K, gb.Q6_K, gb.Q5_0))
def test_activations_quantized_per_group_as_numpy(isa, qtype):
    """The int8 activation rounding itself: scale max |x| / 127 over each group (256 weights for
    the K-quants, 32 otherwise), values rounded half to even. The kernel's product must equal
    that exact quantization times the weights up to float32 accumulation; a per-32 scale on a
    K-quant (or the reverse) is off by up to half an int8 step per weight, far past that."""
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    m, k, n = 3, 768, 24
    rows = gb.random_rows(n, k, qtype, seed=5 + qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7 + qtype))
    # groups of very different sizes, so the per-32 and per-256 roundings differ
    x *= torch.logspace(-2, 1, k // 32).repeat_interleave(32)
    g = activation_group(qtype)
    xg = x.numpy().reshape(m, -1, g)
    amax = np.abs(xg).max(-1, keepdims=True)
    xq = np.rint(xg * (np.float32(127) / amax)).astype(np.float64)  # float32 product, as the kernel
    xdq = (xq * (amax.astype(np.float64) / 127)).reshape(m, k)
    out = torch.empty(m, n)
    get_function("quant_gemm", "quant_matmul_isa", "cpu")(out, x, torch.from_numpy(rows), qtype,
                                                          isa)
    magnitude = np.abs(xdq) @ np.abs(w).T
    assert_close(out, xdq @ w.T, torch.float32, magnitude=magnitude, terms=k)


def test_kquant_rows_must_be_whole_super_blocks():
    rows = torch.from_numpy(gb.random_rows(4, 256, gb.Q4_K, seed=1))
    with pytest.raises(RuntimeError, match="must be a multiple of 256 for qtype 12"):
        ops.quant_matmul(torch.empty(1, 4), torch.randn(1, 288), rows, gb.Q4_K)
    with pytest.raises(RuntimeError, match=r"qtype 10 is not supported: use Q4_0 \(2\)"):
        ops.quant_matmul(torch.empty(1, 4), torch.randn(1, 256), rows, 10)
    with pytest.raises(RuntimeError, match="qtype 10 is not supported"):
        ops.dequantize_rows(torch.empty(1, 256), torch.tensor([0]), rows, 10)


def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("q13,q2", [(gb.Q4_K, gb.Q6_K), (gb.Q5_K, gb.Q5_0), (gb.Q6_K, gb.Q4_K)])
def test_moe_experts_quant_kquants(isa, q13, q2):
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    t, e, k, h, i = 5, 6, 2, 256, 256
    g = np.random.default_rng(q13 * 31 + q2)
    rows13 = gb.random_rows(2 * i, h, q13, seed=q13, lead=(e,))
    rows2 = gb.random_rows(h, i, q2, seed=q2 + 100, lead=(e,))
    w13 = gb.dequantize(rows13, q13).astype(np.float64)
    w2 = gb.dequantize(rows2, q2).astype(np.float64)
    ids = np.stack([g.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    weights = g.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    emap = np.arange(e, dtype=np.int32)
    # activations already int8-exact per 32-block and per super-block (127 in every block): x
    # for gate/up; act is rounded inside (per activation_group(q2)),
    # so the check allows act's int8 rounding (half a step per element) through w2
    x = int8_activations(t, h, seed=3).numpy() / 127.0
    out = torch.full((t, h), float("nan"))
    get_function("moe", "moe_experts_quant_isa", "cpu")(
        out, torch.from_numpy(x), torch.from_numpy(rows13), torch.from_numpy(rows2), q13, q2,
        torch.from_numpy(ids), torch.from_numpy(weights), torch.from_numpy(emap),
        torch.empty(0, dtype=torch.uint8), isa)
    want = np.zeros((t, h))
    allowed = np.zeros((t, h))
    for r in range(t):
        for j in range(k):
            ex = ids[r, j]
            gate, up = w13[ex, :i] @ x[r], w13[ex, i:] @ x[r]
            act = _silu(gate) * up
            g2 = activation_group(q2)
            step = np.abs(act.reshape(-1, g2)).max(-1, keepdims=True) / 127
            half = np.broadcast_to(step / 2, (i // g2, g2)).reshape(i)
            want[r] += weights[r, j] * (w2[ex] @ act)
            mag = np.abs(w13[ex]) @ np.abs(x[r])
            act_err = 1.1 * 16 * eps(torch.float32) * mag[:i] * np.abs(up) + \
                np.abs(_silu(gate)) * 16 * eps(torch.float32) * mag[i:]
            allowed[r] += weights[r, j] * (np.abs(w2[ex]) @ (half + act_err + np.abs(act) * 1e-6))
    allowed += 8 * eps(torch.float32) * np.sqrt(i) * np.abs(want).max()
    excess = np.abs(out.double().numpy() - want) - allowed
    assert excess.max() <= 0, f"worst excess over the bound: {excess.max():.3g}"
