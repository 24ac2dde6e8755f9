"""The scaled-weight kernels (kernels/cuda/scaled_gemm.cu) against torch on the dequantized
weights, every scale layout; and, without a GPU, the bit mapping the kernels decode with.

The weights come from tests/models/scaled_checkpoint.py's quantizers and are dequantized
independently (numpy, bit by bit); the kernels' results must match that float weight's product
within the rounding of a float32 accumulation over K terms and the output dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import (e2m1_values, e4m3_values, expand, quantize_fp8,
                                            quantize_nvfp4)
from tests.tolerances import assert_close

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (N, K, block): 128x128 blocks with cut edges, channel, tensor; K a multiple of 16
FP8_CASES = [(320, 192, (128, 128)), (4096, 4096, (128, 128)), (96, 4096 + 16, (128, 128)),
             (200, 336, (1, 336)), (256, 512, (256, 512))]
NVFP4_CASES = [(320, 192), (4096, 4096), (100, 1040)]


def _half_trick(codes: np.ndarray, shift: int, sign_shift: int, magnitude_mask: int,
                factor: float) -> np.ndarray:
    """The kernels' decode (scaled_decode.cuh): the code's bits placed in an IEEE half."""
    bits = ((codes & (1 << (sign_shift))) << (15 - sign_shift)) | ((codes & magnitude_mask)
                                                                   << shift)
    return bits.astype(np.uint16).view(np.float16).astype(np.float64) * factor


def test_kernel_decode_of_every_e4m3_code_matches_torch():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F])   # NaN codes excluded
    ours = _half_trick(codes, 7, 7, 0x7F, 256.0)
    expected = torch.from_numpy(codes.astype(np.uint8)).view(torch.float8_e4m3fn).double()
    np.testing.assert_array_equal(ours, expected.numpy())
    np.testing.assert_array_equal(ours, e4m3_values(codes.astype(np.uint8)))


def test_kernel_decode_of_every_e2m1_code_matches_the_table():
    codes = np.arange(16)
    ours = _half_trick(codes, 9, 3, 0x7, 16384.0)
    np.testing.assert_array_equal(ours, e2m1_values(codes.astype(np.uint8))[::2])


def _fp8_weight(n, k, block, dev):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    q, grid = quantize_fp8(w, *block)
    ref = e4m3_values(q.view(torch.uint8).numpy()) * expand(grid.double().numpy(), *block, n, k)
    weight = scaled.ScaledWeight(scaled.FP8, q, grid, (n, k), block)
    return scaled.to_device(weight, dev), torch.from_numpy(ref)


def _nvfp4_weight(n, k, dev):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05
    packed, local, second = quantize_nvfp4(w)
    ref = (e2m1_values(packed.numpy()) * expand(e4m3_values(local.view(torch.uint8).numpy()),
                                                1, 16, n, k) * second.item())
    weight = scaled.ScaledWeight(scaled.NVFP4, packed, local, (n, k), (1, 16),
                                 second.reshape(1).expand(n).contiguous())
    return scaled.to_device(weight, dev), torch.from_numpy(ref)


def _check_linear(weight, ref, dtype, tokens):
    from freetoken.models.forward.scaled_linear import ScaledLinear

    dev = weight.data.device
    n, k = weight.shape
    ref = ref.double()
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    out = torch.empty(tokens, n, dtype=dtype, device=dev)
    ScaledLinear(weight)(out, x.to(dev))
    expected = x.double() @ ref.T
    # Independent roundings of the K products add up like a random walk: the scale of the
    # error is the root-sum-square of the products (a wrong scale or index is off by the
    # result itself, which is that size too). GEMV: float32 products and accumulation;
    # larger batches: the weight rounded to `dtype` first, then the tensor-core GEMM.
    rss = ((x.double() ** 2) @ (ref ** 2).T).sqrt()
    if tokens <= 8:
        assert_close(out.cpu(), expected, dtype, compute=torch.float32, magnitude=rss,
                     terms=k, msg=f"T={tokens}")
    else:   # float32 output: the GEMM's own float32 accumulation over K terms rounds too
        terms = k if dtype == torch.float32 else 1
        assert_close(out.cpu(), expected, dtype, magnitude=rss, terms=terms, msg=f"T={tokens}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 8, 37])
@pytest.mark.parametrize("n, k, block", FP8_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_gemv_and_dequantized_gemm_match_torch(n, k, block, tokens, dtype):
    weight, ref = _fp8_weight(n, k, block, torch.device("cuda"))
    _check_linear(weight, ref, dtype, tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("n, k", NVFP4_CASES)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvfp4_gemv_and_dequantized_gemm_match_torch(n, k, tokens, dtype):
    weight, ref = _nvfp4_weight(n, k, torch.device("cuda"))
    _check_linear(weight, ref, dtype, tokens)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dequantize_kernel_is_exact_in_float32(fmt):
    from freetoken.kernel import ops

    dev = torch.device("cuda")
    if fmt == "fp8":
        weight, ref = _fp8_weight(320, 192, (128, 128), dev)
        args = (weight.data.view(torch.uint8), weight.scales, torch.ones(320, device=dev), 0,
                128, 128)
    else:
        weight, ref = _nvfp4_weight(320, 192, dev)
        args = (weight.data, weight.scales.view(torch.uint8), weight.row_scale, 1, 1, 16)
    out = torch.empty(320, 192, dtype=torch.float32, device=dev)
    ops.scaled_dequantize(out, *args)
    # one float32 product (two for NVFP4's second-level scale) per value
    assert_close(out.cpu(), ref, torch.float32, magnitude=ref.abs(), ulps=2)


def _stacked_experts(fmt, slots, rows, cols, seed, dev):
    """A stacked expert weight [S, rows, cols] and its float64 reference (bit by bit)."""
    w = torch.randn(slots, rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "nvfp4":
        packed, local, second = quantize_nvfp4(w)
        ref = (e2m1_values(packed.numpy()) * expand(e4m3_values(local.view(torch.uint8).numpy()),
                                                    1, 16, rows, cols)
               * second.double().numpy()[:, None, None])
        weight = scaled.ScaledWeight(scaled.NVFP4, packed, local, (slots, rows, cols), (1, 16),
                                     second[:, None].expand(slots, rows).contiguous())
    else:
        q, grid = quantize_fp8(w, 128, 128)
        ref = e4m3_values(q.view(torch.uint8).numpy()) * expand(grid.double().numpy(), 128, 128,
                                                                 rows, cols)
        weight = scaled.ScaledWeight(scaled.FP8, q, grid, (slots, rows, cols), (128, 128))
    return scaled.to_device(weight, dev), torch.from_numpy(ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 4, 8, 40])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaled_experts_match_torch(fmt, tokens, dtype):
    """Qwen3-30B-A3B's expert shapes (H 2048, I 768) over 16 slots, 8 experts per token: the
    decode kernel (T <= 8) and the dequantize + grouped GEMM path (T = 40)."""
    from freetoken.kernel import ops, reference
    from freetoken.models.forward.scaled_moe import ScaledExperts

    dev = torch.device("cuda")
    slots, hidden, inter, top_k = 16, 2048, 768, 8
    gate, rg = _stacked_experts(fmt, slots, inter, hidden, 1, dev)
    up, ru = _stacked_experts(fmt, slots, inter, hidden, 2, dev)
    down, rd = _stacked_experts(fmt, slots, hidden, inter, 3, dev)
    experts = ScaledExperts(scaled.concat_rows([gate, up]), scaled.concat_rows([down]), top_k)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(slots, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    emap = torch.arange(slots, dtype=torch.int32)
    workspace = torch.empty(ops.moe_workspace_bytes(tokens, top_k, slots, inter, dtype),
                            dtype=torch.uint8, device=dev)
    out = torch.empty(tokens, hidden, dtype=dtype, device=dev)
    experts(out, x.to(dev), ids.to(dev), weights.to(dev), emap.to(dev), workspace)
    expected = torch.empty(tokens, hidden, dtype=torch.float64)
    reference.moe_experts(expected, x.double(), torch.cat([rg, ru], dim=1), rd, ids, weights,
                          emap, None)
    # bf16: the activations between the projections (and, for T > 8, the dequantized weights)
    # are rounded to bf16, a relative error of one bf16 rounding per product whose sum scales
    # with the result itself; float32: only the accumulation over H + I terms rounds
    scale = expected.abs().max()
    terms = hidden + inter if dtype == torch.float32 else 1
    assert_close(out.cpu(), expected, dtype, compute=dtype, magnitude=scale, terms=terms)
