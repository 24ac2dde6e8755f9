"""moe_experts_scaled on the GPU (kernels/cuda/moe_scaled.cu) against torch over the experts
dequantized independently (numpy, bit by bit: tests/models/scaled_checkpoint.py), for FP8 in
128x128 blocks, FP8 per-row grids with row scales, and NVFP4; with a slot map that remaps,
skips (-1) and points past the slots. Skipped without a GPU.

The kernel rounds the gate/up products' SwiGLU into the activation dtype, then sums the down
rows in float32: the reference does the same in float64 and rounds the activation once, so the
results differ by the float32 sums' roundings and the activation's one rounding, carried
through the down product (a wrong scale, nibble order or slot is off by the result's size).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import (e2m1_values, e4m3_values, expand, quantize_fp8,
                                            quantize_nvfp4)
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I = 6, 256, 192


def _stack(rows: int, cols: int, layout: str, gen) -> tuple[scaled.ScaledWeight, torch.Tensor]:
    """Random experts [E, rows, cols] in `layout` and their float64 values."""
    w = torch.randn(E, rows, cols, generator=gen) * 0.05
    if layout == "nvfp4":
        parts = [quantize_nvfp4(w[e]) for e in range(E)]
        packed = torch.stack([p[0] for p in parts])
        local = torch.stack([p[1] for p in parts])
        second = torch.stack([p[2].reshape(()).expand(rows) for p in parts]).contiguous()
        values = torch.stack([torch.from_numpy(
            e2m1_values(p[0].numpy()) * expand(e4m3_values(p[1].view(torch.uint8).numpy()),
                                               1, 16, rows, cols) * p[2].item()) for p in parts])
        return scaled.ScaledWeight(scaled.NVFP4, packed, local, (E, rows, cols), (1, 16),
                                   second), values
    block = (128, 128) if layout == "fp8-block" else (1, 64)
    q, grid = quantize_fp8(w, *block)
    row_scale = None if layout == "fp8-block" else torch.rand(E, rows, generator=gen) + 0.5
    values = torch.stack([torch.from_numpy(
        e4m3_values(q[e].view(torch.uint8).numpy()) * expand(grid[e].double().numpy(), *block,
                                                             rows, cols)) for e in range(E)])
    if row_scale is not None:
        values = values * row_scale.double()[..., None]
    return scaled.ScaledWeight(scaled.FP8, q, grid, (E, rows, cols), block, row_scale), values


def _reference(x, w13, w2, ids, weights, expert_map, dtype):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if not 0 <= e < expert_map.numel():
                continue
            s = int(expert_map[e])
            if not 0 <= s < w13.shape[0]:
                continue
            gate_up = w13[s] @ x[t].double()
            act = (torch.nn.functional.silu(gate_up[:I]) * gate_up[I:]).to(dtype).double()
            out[t] += float(weights[t, k]) * (w2[s] @ act)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (3, 4), (8, 6)])
@pytest.mark.parametrize("layout", ["fp8-block", "fp8-rows", "nvfp4"])
def test_scaled_experts_match_the_dequantized_experts(layout, tokens, top_k, dtype):
    from freetoken.models.forward.scaled_moe import ScaledExperts

    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    gate, gate_values = _stack(I, H, layout, gen)
    up, up_values = _stack(I, H, layout, gen)
    w2, w2_values = _stack(H, I, layout, gen)
    w13 = scaled.concat_rows([gate, up])
    w13_values = torch.cat([gate_values, up_values], dim=1)
    dev = torch.device("cuda")
    x = (torch.randn(tokens, H, generator=gen)).to(dtype)
    ids = torch.stack([torch.randperm(E + 2, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)                      # ids E and E + 1 are out of range: skipped
    weights = torch.rand(tokens, top_k, generator=gen)
    # slots in reverse order; expert 1 unmapped (-1), expert 2 mapped past the slots
    expert_map = torch.tensor([E - 1 - e for e in range(E)], dtype=torch.int32)
    expert_map[1], expert_map[2] = -1, E + 3
    run = ScaledExperts(scaled.to_device(w13, dev), scaled.to_device(w2, dev), top_k)
    out = torch.full((tokens, H), float("nan"), dtype=dtype, device=dev)
    run(out, x.to(dev), ids.to(dev), weights.to(dev), expert_map.to(dev), None)
    want = _reference(x, w13_values, w2_values, ids, weights, expert_map, dtype)
    # Where the kernel's float32 gate/up sum rounds to the other neighbour of `dtype` than
    # the reference's, that activation is off by one ulp of `dtype`; through the down rows
    # that is at most eps(dtype) * sum |w2| |act| (float32's own sums are far below): the
    # same products over absolute values bound it (silu(|g|) >= |silu(g)|).
    absolute = _reference(x.abs(), w13_values.abs(), w2_values.abs(), ids, weights.abs(),
                          expert_map, torch.float64)
    assert_close(out.cpu(), want, dtype, magnitude=absolute, msg=f"{layout} T={tokens} K={top_k}")
