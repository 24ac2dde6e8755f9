"""The CPU's FP8 kernels (kernels/cpu/scaled_gemm.cc, kernels/cpu/moe_scaled.cc) against float64
products over the weights decoded bit by bit in numpy (tests/models/scaled_checkpoint.py), every
scale layout: 128x128 blocks with cut edges, per-channel with row scales, per-tensor, and
blocks of 8 and 64 columns (the CPU takes any multiple of 8).

The kernels accumulate in float32 over K products, so the bound is float32 rounding of a
K-term sum with the root-sum-square of the products as its magnitude; a wrong block, row or
scale is off by the result itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import e4m3_values, expand, quantize_fp8
from tests.tolerances import assert_close

# (N, K, block, with row scales)
CASES = [(320, 192, (128, 128), False), (96, 4096 + 16, (128, 128), False),
         (200, 336, (1, 336), True), (256, 512, (256, 512), False), (61, 72, (8, 8), True),
         (130, 200, (3, 64), True)]


def fp8_weight(n: int, k: int, block: tuple[int, int], rows: bool, seed: int = 0):
    """(codes uint8 [N, K], grid float32, row scales float32 [N], float64 reference [N, K])."""
    gen = torch.Generator().manual_seed(seed + n * k)
    q, grid = quantize_fp8(torch.randn(n, k, generator=gen) * 0.05, *block)
    row_scale = torch.rand(n, generator=gen) + 0.5 if rows else torch.ones(n)
    ref = (e4m3_values(q.view(torch.uint8).numpy())
           * expand(grid.double().numpy(), *block, n, k) * row_scale.double().numpy()[:, None])
    return q.view(torch.uint8), grid.float().contiguous(), row_scale, torch.from_numpy(ref)


def assert_product(out, x, ref, msg="", bias=None):
    """out = x @ ref.T (+ bias) within float32 rounding of a K-term sum."""
    expected = x.double() @ ref.T
    rss = ((x.double() ** 2) @ (ref ** 2).T).sqrt()
    if bias is not None:
        expected, rss = expected + bias.double(), rss + bias.double().abs()
    assert_close(out, expected, torch.float32, magnitude=rss, terms=x.shape[1], msg=msg)


@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 9, 33])
@pytest.mark.parametrize("n, k, block, rows", CASES)
def test_scaled_gemv_matches_the_decoded_weight(n, k, block, rows, tokens):
    codes, grid, row_scale, ref = fp8_weight(n, k, block, rows)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens))
    out = torch.full((tokens, n), float("nan"))
    ops.scaled_gemv(out, x, codes, grid, row_scale, 0, *block)
    assert_product(out, x, ref, f"T={tokens}")


@pytest.mark.parametrize("n, k, block, rows", CASES)
def test_scaled_dequantize_is_the_reference_rule_exactly(n, k, block, rows):
    """One float32 product by the grid, then one by the row scale, as scaled.dequantize."""
    codes, grid, row_scale, _ = fp8_weight(n, k, block, rows)
    out = torch.full((n, k), float("nan"))
    ops.scaled_dequantize(out, codes, grid, row_scale, 0, *block)
    weight = scaled.ScaledWeight(scaled.FP8, codes.view(torch.float8_e4m3fn), grid, (n, k), block,
                                 row_scale if rows else None)
    assert torch.equal(out, scaled.dequantize(weight))


def test_every_e4m3_code_decodes_exactly():
    """A row of every finite code against torch's own float8 conversion."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = codes.numel() // 8 * 8
    codes = codes[:k].view(1, k).contiguous()
    out = torch.empty(1, k)
    ops.scaled_dequantize(out, codes, torch.ones(1, 1), torch.ones(1), 0, 1, k)
    assert torch.equal(out, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("call, match", [
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x, c, g, r, 1, 128, 128), "NVFP4 weights have no CPU"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x, c, g, r, 2, 128, 128), "format must be 0"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x, c, g[:1], r, 0, 128, 128),
     r"scales must be \[3, 2\]"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x, c, g, r[:5], 0, 128, 128),
     "row_scale must hold one value per row"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x, c, g, r, 0, 128, 12), "multiple of 8 columns"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x[:, :64].contiguous(), c, g, r, 0, 128, 128),
     r"x must be \[T, K=192\]"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o[:, :7].contiguous(), x, c, g, r, 0, 128, 128), "out must be"),
    (lambda c, g, r, x, o: ops.scaled_gemv(o, x.double(), c, g, r, 0, 128, 128), "float32"),
    (lambda c, g, r, x, o: ops.scaled_dequantize(o, c, g, r, 0, 128, 128), r"out must be \[320"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    codes, grid, row_scale, _ = fp8_weight(320, 192, (128, 128), False)
    x, out = torch.randn(2, 192), torch.empty(2, 320)
    with pytest.raises(Exception, match=match):
        call(codes, grid, row_scale, x, out)


# ---- routed experts -----------------------------------------------------------------------

def stacked(slots: int, rows: int, cols: int, block, with_rows: bool, seed: int):
    parts = [fp8_weight(rows, cols, block, with_rows, seed * 100 + s) for s in range(slots)]
    codes, grid, row_scale, ref = (torch.stack([p[i] for p in parts]) for i in range(4))
    return (codes.contiguous(), grid.contiguous(), row_scale.contiguous()), ref


def expected_experts(x, ref13, ref2, ids, weights, emap):
    """float64 out and the magnitude its rounding scales with (sum of |terms| per output)."""
    inter = ref2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    scale = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            s = int(emap[int(ids[t, k])])
            gu = ref13[s] @ x[t].double()
            gu_mag = ref13[s].abs() @ x[t].double().abs()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            act_mag = gu_mag[:inter] * gu_mag[inter:]
            out[t] += float(weights[t, k]) * (ref2[s] @ act)
            scale[t] += float(weights[t, k]) * (ref2[s].abs() @ act_mag)
    return out, scale


@pytest.mark.parametrize("tokens", [1, 3, 8, 40])
@pytest.mark.parametrize("layout", ["block", "rows", "tensor"])
def test_moe_experts_scaled_matches_the_decoded_experts(layout, tokens):
    slots, experts, hidden, inter, top_k = 6, 8, 256, 192, 4
    b13, b2, with_rows = {"block": ((128, 128), (128, 128), False),
                          "rows": ((1, 64), (1, 64), True),
                          "tensor": ((2 * inter, hidden), (hidden, inter), False)}[layout]
    w13, ref13 = stacked(slots, 2 * inter, hidden, b13, with_rows, 1)
    w2, ref2 = stacked(slots, hidden, inter, b2, with_rows, 2)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    emap = torch.tensor([3, 0, 5, 1, 2, 4, 0, 3], dtype=torch.int32)   # shared slots too
    out = torch.full((tokens, hidden), float("nan"))
    ops.moe_experts_scaled(out, x, *w13, *w2, 0, *b13, *b2, ids, weights, emap, torch.empty(0))
    expected, scale = expected_experts(x, ref13, ref2, ids, weights, emap)
    # float32 products and sums through gate/up (H terms), SwiGLU and down (I terms)
    assert_close(out, expected, torch.float32, magnitude=scale, terms=hidden + inter,
                 msg=f"{layout} T={tokens}")


def test_moe_experts_scaled_refuses_bad_experts_by_name():
    w13, _ = stacked(2, 64, 32, (1, 32), False, 1)
    w2, _ = stacked(3, 32, 32, (1, 32), False, 2)
    x, out = torch.randn(1, 32), torch.empty(1, 32)
    routing = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1),
               torch.zeros(1, dtype=torch.int32), torch.empty(0))
    with pytest.raises(Exception, match="w13 and w2 must hold the same expert slots"):
        ops.moe_experts_scaled(out, x, *w13, *w2, 0, 1, 32, 1, 32, *routing)
    w2, _ = stacked(2, 32, 32, (1, 32), False, 2)
    with pytest.raises(Exception, match=r"w2_scales must be \[2, 32, 2\]"):
        ops.moe_experts_scaled(out, x, *w13, *w2, 0, 1, 32, 1, 16, *routing)
    with pytest.raises(Exception, match="NVFP4 weights have no CPU kernel"):
        ops.moe_experts_scaled(out, x, *w13, *w2, 1, 1, 32, 1, 32, *routing)
    with pytest.raises(Exception, match="w13_rows must hold one value per row"):
        ops.moe_experts_scaled(out, x, w13[0], w13[1], w13[2][:, :3].contiguous(), *w2, 0, 1, 32, 1, 32,
                               *routing)
    bad_ids = (torch.full((1, 1), 9, dtype=torch.int32),) + routing[1:]
    with pytest.raises(Exception, match="outside the E=1 experts"):
        ops.moe_experts_scaled(out, x, *w13, *w2, 0, 1, 32, 1, 32, *bad_ids)


def test_host_scaled_linear_takes_both_paths_alike():
    """The CPU projection: scaled_gemv up to SMALL_PRODUCT_ROWS rows, the dequantized weight
    through BLAS beyond; both against the decoded weight, with a bias."""
    from freetoken.models.forward.linear import SMALL_PRODUCT_ROWS, make_linear

    codes, grid, row_scale, ref = fp8_weight(130, 200, (3, 64), True)
    weight = scaled.ScaledWeight(scaled.FP8, codes.view(torch.float8_e4m3fn), grid, (130, 200),
                                 (3, 64), row_scale)
    bias = np.linspace(-1, 1, 130, dtype=np.float32)
    linear = make_linear(weight, bias)
    assert type(linear).__name__ == "HostScaledLinear"
    for tokens in (1, SMALL_PRODUCT_ROWS, SMALL_PRODUCT_ROWS + 1, 50):
        x = np.random.default_rng(tokens).standard_normal((tokens, 200), dtype=np.float32)
        out = np.full((tokens, 130), np.nan, dtype=np.float32)
        linear(out, x)
        assert_product(torch.from_numpy(out), torch.from_numpy(x), ref, f"T={tokens}",
                       torch.from_numpy(bias))
