"""The Gated DeltaNet kernels (short causal conv, gated delta-rule recurrence) against a float64
torch reference written from the formulas: token by token, per sequence, with states carried
over between calls through their slots (chunked prefill, then decode steps, in mixed batches).

Bounds: float32 compute rounds each product/sum at unit roundoff u, so the error is u times the
magnitudes involved times sqrt of the accumulation length (K taps; dk for k^T S and q^T S, and
the state sums over every past token); bf16/f16 inputs and outputs add one rounding of the
output (and of the inputs, which the reference reads after the same rounding).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernel import ops

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


class Reference:
    """float64 states per slot; ``step`` runs one batch of chunks like the kernels."""

    def __init__(self, slots, channels, k, hv, dk, dv):
        self.conv = torch.zeros(slots, channels, k - 1, dtype=torch.float64)
        self.ssm = torch.zeros(slots, hv, dk, dv, dtype=torch.float64)

    def conv1d(self, x, weight, chunks):
        out = torch.empty_like(x)
        for slot, start, (a, b) in chunks:
            hist = torch.zeros_like(self.conv[slot]) if start == 0 else self.conv[slot]
            seq = torch.cat([hist, x[a:b].T], dim=1)             # [C, K-1+n]
            y = F.conv1d(seq[None], weight[:, None], groups=seq.shape[0])[0]
            out[a:b] = F.silu(y).T
            self.conv[slot] = seq[:, -(weight.shape[1] - 1):]
        return out

    def recurrence(self, qkv, ba, a_log, dt_bias, chunks, hk, dk, dv):
        hv = a_log.numel()
        out = torch.zeros(qkv.shape[0], hv * dv, dtype=torch.float64)
        for slot, start, (a, b) in chunks:
            if start == 0:
                self.ssm[slot] = 0
            for t in range(a, b):
                for h in range(hv):
                    kh = h // (hv // hk)
                    kk = qkv[t, (hk + kh) * dk:(hk + kh + 1) * dk]
                    kk = kk / torch.sqrt((kk * kk).sum() + 1e-6)
                    q = qkv[t, kh * dk:(kh + 1) * dk]
                    q = q / torch.sqrt((q * q).sum() + 1e-6) / math.sqrt(dk)
                    v = qkv[t, 2 * hk * dk + h * dv:2 * hk * dk + (h + 1) * dv]
                    beta = torch.sigmoid(ba[t, h])
                    g = -a_log[h].exp() * F.softplus(ba[t, hv + h] + dt_bias[h])
                    s = self.ssm[slot, h] * g.exp()
                    s = s + torch.outer(kk, beta * (v - kk @ s))
                    self.ssm[slot, h] = s
                    out[t, h * dv:(h + 1) * dv] = q @ s
        return out


def run_case(device, dtype, hk=2, hv=4, dk=64, dv=16, k=4):
    gen = torch.Generator().manual_seed(0)
    c = 2 * hk * dk + hv * dv
    weight = 0.5 * torch.randn(c, k, generator=gen)
    a_log = torch.linspace(-2, 1, hv)
    dt_bias = 0.3 * torch.randn(hv, generator=gen)
    slots = 3
    ref = Reference(slots, c, k, hv, dk, dv)
    conv_state = torch.zeros(slots, c, k - 1, dtype=dtype, device=device)
    ssm_state = torch.zeros(slots, hv, dk, dv, dtype=torch.float32, device=device)
    lengths = {0: 0, 2: 0}      # slot -> tokens seen
    # steps: (slot, new tokens): prefill chunks of different lengths, then decodes side by side
    steps = [[(0, 5), (2, 9)], [(0, 3), (2, 1)], [(0, 1), (2, 1)], [(0, 1), (2, 1)]]
    worst = 0.0
    for step in steps:
        n = sum(size for _, size in step)
        x = torch.randn(n, c + 7, generator=gen)[:, 3:3 + c]       # strided rows, like a slice
        ba = torch.randn(n, 2 * hv + 2, generator=gen)[:, 1:1 + 2 * hv]
        x_low, ba_low = x.to(dtype), ba.to(dtype)
        chunks, positions, start = [], [], 0
        for slot, size in step:
            chunks.append((slot, lengths[slot], (start, start + size)))
            positions += range(lengths[slot], lengths[slot] + size)
            lengths[slot] += size
            start += size
        qs = torch.tensor([0] + [b for _, _, (_, b) in chunks], dtype=torch.int32)
        slot_ids = torch.tensor([s for s, _, _ in chunks], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        to = {"device": device}
        conv_out = torch.empty(n, c, dtype=dtype, device=device)
        ops.gdn_conv1d(conv_out, x_low.to(**to), conv_state, weight.to(dtype).to(**to),
                       pos.to(**to), qs.to(**to), slot_ids.to(**to))
        ref_conv = ref.conv1d(x_low.double(), weight.to(dtype).double(), chunks)
        u = UNIT[dtype]
        conv_bound = (2 * u + 4 * math.sqrt(k) * UNIT[torch.float32]) * (
            ref_conv.abs() + 0.5 * x.abs().max() * k) + 1e-6
        diff = (conv_out.cpu().double() - ref_conv).abs()
        assert (diff <= conv_bound).all(), f"conv {float(diff.max()):.3g}"
        core = torch.empty(n, hv * dv, dtype=dtype, device=device)
        ops.gdn_recurrence(core, conv_out, ba_low.to(**to), a_log.to(**to), dt_bias.to(**to),
                           ssm_state, pos.to(**to), qs.to(**to), slot_ids.to(**to))
        ref_core = ref.recurrence(conv_out.cpu().double(), ba_low.double(), a_log.double(),
                                  dt_bias.double(), chunks, hk, dk, dv)
        scale = ref.ssm.abs().max() + 1.0   # what q^T S and the state sums scale with
        bound = 2 * u * ref_core.abs() + 16 * math.sqrt(dk * max(lengths.values())) * \
            UNIT[torch.float32] * scale + u * scale
        diff = (core.cpu().double() - ref_core).abs()
        worst = max(worst, float(diff.max()))
        assert (diff <= bound).all(), f"recurrence {float(diff.max()):.3g}"
        state_diff = (ssm_state.cpu().double()[[0, 2]] - ref.ssm[[0, 2]]).abs().max()
        assert state_diff <= 16 * math.sqrt(dk * max(lengths.values())) * \
            UNIT[torch.float32] * scale + u * scale
    assert float(ssm_state[1].abs().max()) == 0.0    # an unused slot stays untouched
    return worst


def test_gdn_kernels_cpu_match_reference():
    run_case("cpu", torch.float32)


def test_gdn_rejects_a_slot_outside_the_pool():
    c, k = 8 * 4 + 16, 4
    x = torch.zeros(2, c)
    with pytest.raises(Exception, match="state_slots"):
        ops.gdn_conv1d(torch.empty_like(x), x, torch.zeros(2, c, k - 1), torch.zeros(c, k),
                       torch.zeros(2, dtype=torch.int64), torch.tensor([0, 2], dtype=torch.int32),
                       torch.tensor([5], dtype=torch.int32))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv", [(64, 32), (128, 32), (128, 20), (256, 16)])
def test_gdn_kernels_cuda_match_reference(dtype, dk, dv):
    """dv 20: a block whose last 4 columns lie past the head (lanes idle but in the sums)."""
    run_case(torch.device("cuda", torch.cuda.current_device()), dtype, dk=dk, dv=dv)
