"""Reference for the small-step MoE decode kernels, on any torch device: the unfused chain in
f32 with its roundings to the activation dtype, and an error bound derived from them."""

from __future__ import annotations

import torch

from tests.tolerances import EPS


def _gu_mag(gu):
    """How far one SwiGLU output moves when its gate and up inputs are each an ulp off."""
    half = gu.shape[-1] // 2
    return (gu[..., :half].abs() + 1) * (gu[..., half:].abs() + 1)


def reference_decode(x, w13, w2, ids, weights, emap, shared=None):
    """(y f32 [T, H], bound [T, H]). shared: (w13 [2Is, H], w2 [H, Is], gate [1, H] or None).
    The bound lets every rounded intermediate be one ulp off (another f32 summation order may
    round it to the neighbour), carried through the products it feeds, plus y's own rounding."""
    dtype = x.dtype
    r = lambda v: v.to(dtype).float()  # noqa: E731
    eps, inter = EPS[str(dtype).replace("torch.", "")], w13.shape[1] // 2
    xf = x.float()
    y = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    mag = torch.zeros_like(y)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            s = int(emap[ids[t, k]])
            if s < 0:
                continue
            gu = w13[s].float() @ xf[t]
            act = r(torch.nn.functional.silu(r(gu[:inter])) * r(gu[inter:]))
            w2s = w2[s].float()
            y[t] += weights[t, k] * (w2s @ act)
            mag[t] += weights[t, k] * (w2s.abs() @ (act.abs() + 4 * eps * _gu_mag(gu)))
    y = r(y)
    if shared is not None:
        sw13, sw2, gw = (None if v is None else v.float() for v in shared)
        si = sw2.shape[1]
        gu = xf @ sw13.T
        act = r(torch.nn.functional.silu(r(gu[:, :si])) * r(gu[:, si:]))
        s = r(act @ sw2.T)
        g = r(torch.sigmoid(r(xf @ gw.T))) if gw is not None else torch.ones_like(s[:, :1])
        y = r(y + g * s)
        mag += (act.abs() + 4 * eps * _gu_mag(gu)) @ sw2.abs().T + s.abs()
    return y, 4 * eps * (mag + y.abs())


def assert_within(out, ref, bound):
    err = (out.float() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
