"""The check of ops.rms_norm_gated shared by the CPU and CUDA kernel tests: x and z as column
slices of one wider projection row (as the GDN layer passes them), normed in place per group."""

from __future__ import annotations

import torch

from freetoken.kernel import ops, reference
from tests.tolerances import assert_close


def check_gated_norm(device, dtype, tokens: int, groups: int, width: int, ulps: float) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + groups * width)
    w_all = groups * width
    row = torch.randn(tokens, 3 * w_all + 8, generator=gen).to(dtype).to(device)
    x, z = row[:, 8:8 + w_all], row[:, 8 + w_all:8 + 2 * w_all]     # strided rows
    weight = torch.randn(width, generator=gen).to(dtype).to(device)
    want = torch.empty(tokens, w_all, dtype=dtype, device=device)
    reference.rms_norm_gated(want, x, z, weight, 1e-6)
    # The norm is rounded to the dtype before the gate multiplies it: a one-ulp difference
    # there (f32 sums in another order) is scaled by |silu(z)|, so the error scales with the
    # unrounded product.
    xg = x.float().reshape(tokens, groups, width)
    normed = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    magnitude = (normed.reshape(tokens, w_all) * torch.nn.functional.silu(z.float())).abs()
    untouched = row[:, 8 + 2 * w_all:].clone()
    ops.rms_norm_gated(x, x, z, weight, 1e-6)                       # in place, as the layer does
    assert_close(x.cpu(), want.cpu(), dtype, magnitude=magnitude.cpu(), ulps=ulps,
                 msg=f"rms_norm_gated {dtype} T={tokens} {groups}x{width}")
    assert torch.equal(row[:, 8 + 2 * w_all:], untouched)
