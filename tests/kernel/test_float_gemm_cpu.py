"""float_matmul (CPU): small f32 x f32/f16/bf16 products on the kernels' pool, against float64
numpy on the same (rounded) weights, and bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from tests.tolerances import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 512, 32), (1, 64, 4099), (2, 96, 7), (5, 1536, 300),
                                   (8, 8, 1), (37, 512, 32), (300, 64, 4)])
def test_float_matmul_against_float64(dtype, m, k, n):
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
    out = torch.full((m, n), float("nan"))
    ops.float_matmul(out, x, w)
    want = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    assert_close(out, want, torch.float32, magnitude=magnitude, terms=k)


def test_float_matmul_refuses_bad_input():
    x, w = torch.randn(2, 64), torch.randn(16, 64)
    with pytest.raises(Exception, match=r"w must be \[N, K=64\]"):
        ops.float_matmul(torch.empty(2, 16), x, torch.randn(16, 32))
    with pytest.raises(Exception, match=r"out must be \[2, 16\]"):
        ops.float_matmul(torch.empty(2, 8), x, w)
    with pytest.raises(Exception, match="w must be float32, bfloat16 or float16"):
        ops.float_matmul(torch.empty(2, 16), x, w.to(torch.int32))
    with pytest.raises(Exception, match="contiguous"):
        ops.float_matmul(torch.empty(2, 16), x, torch.randn(64, 16).T)


@pytest.mark.parametrize("every_step", [False, True])
def test_dense_linear_small_products_on_the_pool(every_step):
    """Decode-sized products take float_matmul; larger ones BLAS, except through a weight every
    step calls (an MoE router); each against float64."""
    from freetoken.models.forward.linear import SMALL_PRODUCT_ROWS, DenseLinear

    g = np.random.default_rng(0)
    w = g.standard_normal((48, 64), dtype=np.float32)
    bias = g.standard_normal(48).astype(np.float32)
    linear = DenseLinear(w, bias, every_step=every_step)
    assert linear._small is not None
    assert linear._small_rows == (float("inf") if every_step else SMALL_PRODUCT_ROWS)
    for rows in (1, SMALL_PRODUCT_ROWS, SMALL_PRODUCT_ROWS + 9):
        x = g.standard_normal((rows, 64), dtype=np.float32)
        out = np.full((rows, 48), np.nan, dtype=np.float32)
        linear(out, x)
        want = x.astype(np.float64) @ w.T.astype(np.float64) + bias
        magnitude = np.abs(x.astype(np.float64)) @ np.abs(w.T.astype(np.float64)) + np.abs(bias)
        assert_close(torch.from_numpy(out), torch.from_numpy(want), torch.float32,
                     magnitude=torch.from_numpy(magnitude), terms=64)
