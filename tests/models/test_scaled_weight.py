"""ScaledWeight row operations (what the GPU path does to q/k/v, gate/up and expert tensors
before the kernels see them): each must keep every value, checked against dequantizing the
parts separately."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import quantize_fp8, quantize_nvfp4
from tests.tolerances import assert_close


def _fp8(rows, cols, block, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    block = (block[0] or rows, block[1] or cols)
    q, grid = quantize_fp8(w, *block)
    return scaled.ScaledWeight(scaled.FP8, q, grid, (rows, cols), block)


def _nvfp4(rows, cols, seed):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    packed, local, second = quantize_nvfp4(w)
    return scaled.ScaledWeight(scaled.NVFP4, packed, local, (rows, cols), (1, 16),
                               second.reshape(1).expand(rows).contiguous())


# (rows of each part, block): blocks that divide the parts, blocks that do not, per tensor
FP8_PARTS = [((256, 128, 128), (128, 128)), ((192, 96, 96), (128, 128)),
             ((192, 96, 96), (0, 0)), ((64, 32), (1, 0))]


@pytest.mark.parametrize("rows, block", FP8_PARTS)
def test_concatenated_fp8_rows_keep_every_value(rows, block):
    parts = [_fp8(r, 192, block, i) for i, r in enumerate(rows)]
    joined = scaled.concat_rows(parts)
    assert joined is not None and joined.shape == (sum(rows), 192)
    expected = torch.cat([scaled.dequantize(p) for p in parts])
    torch.testing.assert_close(scaled.dequantize(joined), expected, rtol=0, atol=0)


def test_concatenated_nvfp4_rows_keep_their_own_second_scales():
    parts = [_nvfp4(r, 64, i) for i, r in enumerate((48, 16, 16))]
    joined = scaled.concat_rows(parts)
    expected = torch.cat([scaled.dequantize(p) for p in parts])
    torch.testing.assert_close(scaled.dequantize(joined), expected, rtol=0, atol=0)


def test_mixed_formats_stay_apart():
    assert scaled.concat_rows([_fp8(32, 64, (1, 0), 0), _nvfp4(32, 64, 1)]) is None


@pytest.mark.parametrize("start, stop", [(0, 160), (160, 320), (128, 256), (0, 320)])
def test_row_slices_of_a_block_grid(start, stop):
    weight = _fp8(320, 192, (128, 128), 7)
    part = scaled.slice_rows(weight, start, stop)
    torch.testing.assert_close(scaled.dequantize(part), scaled.dequantize(weight)[start:stop],
                               rtol=0, atol=0)


def test_stacked_experts_with_per_tensor_scales():
    experts = [_fp8(40, 64, (0, 0), e) for e in range(3)]
    stacked = scaled.stack(experts)
    assert stacked.shape == (3, 40, 64)
    expected = torch.stack([scaled.dequantize(e) for e in experts])
    torch.testing.assert_close(scaled.dequantize(stacked), expected, rtol=0, atol=0)


@pytest.mark.parametrize("tokens", [2, 20])
@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor", "nvfp4"])
def test_scaled_linear_passes_fused_weights_to_the_kernels(fmt, tokens, monkeypatch):
    """The GPU projection's wiring (byte views, scale grids, blocks, row scales, the GEMV /
    dequantize-then-GEMM split) on the CPU, with the kernels' torch references in their place."""
    from freetoken.kernel import ops, reference
    from freetoken.models.forward.scaled_linear import ScaledLinear

    monkeypatch.setattr(ops, "scaled_gemv", reference.scaled_gemv)
    monkeypatch.setattr(ops, "scaled_dequantize", reference.scaled_dequantize)
    if fmt == "nvfp4":
        parts = [_nvfp4(r, 64, i) for i, r in enumerate((48, 16, 16))]
    else:
        block = (128, 128) if fmt == "fp8-block" else (0, 0)
        parts = [_fp8(r, 192, block, i) for i, r in enumerate((192, 96, 96))]
    joined = scaled.concat_rows(parts)
    linear = ScaledLinear(joined)
    x = torch.randn(tokens, joined.shape[1], generator=torch.Generator().manual_seed(tokens))
    out = torch.empty(tokens, joined.shape[0])
    linear(out, x)
    weight = torch.cat([scaled.dequantize(p) for p in parts]).double()
    expected = x.double() @ weight.T
    assert_close(out, expected, torch.float32, terms=weight.shape[1],
                 magnitude=(x.double().abs() @ weight.abs().T))


def _stacked(fmt, slots, rows, cols, seed):
    w = torch.randn(slots, rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.2
    if fmt == "nvfp4":
        packed, local, second = quantize_nvfp4(w)
        return scaled.ScaledWeight(scaled.NVFP4, packed, local, (slots, rows, cols), (1, 16),
                                   second[:, None].expand(slots, rows).contiguous())
    q, grid = quantize_fp8(w, 128, 128)
    return scaled.ScaledWeight(scaled.FP8, q, grid, (slots, rows, cols), (128, 128))


@pytest.mark.parametrize("tokens", [3, 12])
@pytest.mark.parametrize("fmt, hidden, inter", [("fp8-block", 64, 160), ("fp8-block", 128, 256),
                                                ("nvfp4", 64, 160)])
def test_scaled_experts_wiring_matches_float_experts(fmt, hidden, inter, tokens, monkeypatch):
    """The GPU experts' wiring (per-slot views, block arguments, the decode kernel / dequantize-
    then-grouped-GEMM split) on the CPU, the kernels replaced by their torch references."""
    from freetoken.kernel import ops, reference
    from freetoken.models.forward.scaled_moe import ScaledExperts

    for name in ("moe_experts_scaled", "moe_experts", "scaled_dequantize"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    slots, top_k = 4, 2
    gate, up = _stacked(fmt, slots, inter, hidden, 1), _stacked(fmt, slots, inter, hidden, 2)
    w13 = scaled.concat_rows([gate, up])
    w2 = scaled.concat_rows([_stacked(fmt, slots, hidden, inter, 3)])
    experts = ScaledExperts(w13, w2, top_k)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randint(0, slots, (tokens, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    emap = torch.arange(slots, dtype=torch.int32)
    out, expected = torch.empty(tokens, hidden), torch.empty(tokens, hidden)
    experts(out, x, ids, weights, emap, torch.empty(0, dtype=torch.uint8))
    floats13 = torch.cat([scaled.dequantize(gate), scaled.dequantize(up)], dim=1)
    reference.moe_experts(expected, x, floats13, scaled.dequantize(w2), ids, weights, emap, None)
    assert_close(out, expected, torch.float32, terms=hidden + inter)
