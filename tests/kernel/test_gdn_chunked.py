"""The chunked form of the gated delta rule that the GPU prefill uses (kernels/cuda/gdn.cu,
chunked_kernel), written here step for step in float32 torch, against the sequential recurrence
in float64; and on the GPU, the chunked kernel against the sequential one and the float64
reference.

Per sequence and value head, chunks of C tokens with the state S0 before each:
  G_i = g_0 + ... + g_i (the log decays, inclusive), within the chunk
  A_ij = beta_i exp(G_i - G_j) k_i.k_j for j < i (strictly lower)
  D = (I + A)^-1 beta (V - exp(G) K S0), by forward substitution (the UT correction)
  O_i = exp(G_i) q_i S0 + sum_{j <= i} exp(G_i - G_j) (q_i.k_j) D_j
  S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j D_j^T
which unrolls the token-by-token S_t = e^g_t S_{t-1} + k_t beta_t (v_t - k_t e^g_t S_{t-1}).

Bounds: float32 rounding (unit u) over sums of length dk (products with S) and C (the chunk
sums), times the magnitudes involved, as in test_gdn.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernel import ops
from tests.kernel.test_gdn import Reference, gpu

U32 = 2.0 ** -24


def chunked_head(q, k, v, beta, g, s0, chunk):
    """One sequence, one head, float32: q, k [T, dk] (normalized, q scaled), v [T, dv], beta,
    g [T]; s0 [dk, dv]. Returns (out [T, dv], final state), chunk by chunk as the kernel."""
    out, s = torch.empty_like(v), s0.clone()
    for c0 in range(0, q.shape[0], chunk):
        kc, qc, vc = k[c0:c0 + chunk], q[c0:c0 + chunk], v[c0:c0 + chunk]
        n, bc = kc.shape[0], beta[c0:c0 + chunk]
        gc = torch.cumsum(g[c0:c0 + chunk], 0)
        d = bc[:, None] * (vc - gc.exp()[:, None] * (kc @ s))
        decay = (gc[:, None] - gc[None, :]).tril().exp().tril()   # exp(G_i - G_j), j <= i
        a = (bc[:, None] * decay * (kc @ kc.T)).tril(-1)
        for i in range(1, n):                                      # forward substitution
            d[i] = d[i] - a[i, :i] @ d[:i]
        p = decay * (qc @ kc.T)
        out[c0:c0 + n] = gc.exp()[:, None] * (qc @ s) + p @ d
        s = gc[-1].exp() * s + (decay[-1][:, None] * kc).T @ d
    return out, s


def sequential_head(q, k, v, beta, g, s0):
    """The token-by-token recurrence in float64."""
    s, out = s0.double().clone(), torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        s = s * math.exp(float(g[t]))
        s = s + torch.outer(k[t].double(), beta[t].double() * (v[t].double() - k[t].double() @ s))
        out[t] = q[t].double() @ s
    return out, s


def random_head(gen, n, dk, dv):
    q = F.normalize(torch.randn(n, dk, generator=gen), dim=-1) / math.sqrt(dk)
    k = F.normalize(torch.randn(n, dk, generator=gen), dim=-1)
    v = torch.randn(n, dv, generator=gen)
    beta = torch.sigmoid(torch.randn(n, generator=gen))
    # decays from ~0.05 to ~1 per token, as A_log in (-2, 1) and softplus give
    g = -torch.rand(n, generator=gen) * 3.0
    g[::7] = -1e-3
    s0 = torch.randn(dk, dv, generator=gen)
    return q, k, v, beta, g, s0


@pytest.mark.parametrize("chunk", [64, 32])
def test_chunked_form_matches_the_sequential_recurrence(chunk):
    """Several sequences with ragged last chunks (1, C - 1, C, C + 1, 2.5 C tokens) from
    nonzero states; the float32 chunked result within the rounding bound of float64."""
    gen = torch.Generator().manual_seed(0)
    dk, dv = 64, 32
    for n in (1, chunk - 1, chunk, chunk + 1, 5 * chunk // 2):
        q, k, v, beta, g, s0 = random_head(gen, n, dk, dv)
        got, state = chunked_head(q, k, v, beta, g, s0, chunk)
        want, want_state = sequential_head(q, k, v, beta, g, s0)
        scale = float(want_state.abs().max()) + float(s0.abs().max()) + 1.0
        bound = 64 * math.sqrt(dk * chunk) * U32 * scale
        assert float((got.double() - want).abs().max()) <= bound, n
        assert float((state.double() - want_state).abs().max()) <= bound, n


def test_the_chunked_form_is_not_the_undecayed_one():
    """The check above can fail: dropping the in-chunk decay of A gives another answer."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, beta, g, s0 = random_head(gen, 70, 64, 32)
    got, _ = chunked_head(q, k, v, beta, g * 0.5, s0, 64)
    want, _ = sequential_head(q, k, v, beta, g, s0)
    assert float((got.double() - want).abs().max()) > 1e-2


def run_recurrence(qkv, ba, a_log, dt_bias, state, lengths, splits, device, fresh=()):
    """ops.gdn_recurrence over sequences of `lengths` (slots 0.., from `state`; the slots in
    `fresh` start at position 0, so from a zero state), each cut into calls of `splits` tokens
    at most; returns (out, state)."""
    hv = a_log.numel()
    out = torch.empty(qkv.shape[0], hv * state.shape[-1], dtype=qkv.dtype, device=device)
    state = state.clone().to(device)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        rows, qs, slots, pos = [], [0], [], []
        for b, (s0, n) in enumerate(zip(starts, lengths)):
            take = min(splits, n - done[b])
            if take == 0:
                continue
            rows += range(s0 + done[b], s0 + done[b] + take)
            first = done[b] + (0 if b in fresh else 1)   # position 0: a fresh sequence
            pos += range(first, first + take)
            qs.append(qs[-1] + take)
            slots.append(b)
            done[b] += take
        idx = torch.tensor(rows, device=device)
        part = torch.empty(len(rows), out.shape[1], dtype=qkv.dtype, device=device)
        to = {"device": device}
        ops.gdn_recurrence(part, qkv[idx], ba[idx], a_log.to(**to), dt_bias.to(**to), state,
                           torch.tensor(pos, dtype=torch.int64, **to),
                           torch.tensor(qs, dtype=torch.int32, **to),
                           torch.tensor(slots, dtype=torch.int32, **to))
        out[idx] = part
    return out, state


def test_the_split_harness_on_the_cpu_kernel():
    """The GPU comparison below, run on the CPU kernel (sequential either way): its reference,
    fresh slot and bounds hold."""
    compare_calls("cpu", torch.float32, 64, 32)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dk, dv", [(64, 96), (128, 128), (256, 128)])
def test_chunked_gpu_prefill_matches_the_sequential_kernel(dtype, dk, dv):
    compare_calls("cuda", dtype, dk, dv)


def compare_calls(device, dtype, dk, dv):
    """Sequences of 1, 63, 64, 65, 200 and 300 tokens in one call (the step has >= 64 tokens
    more than sequences: the chunked kernel) against the same sequences fed 8 tokens a call
    (at most 48 tokens for 6 sequences: the sequential kernel) and the float64 reference, from
    random nonzero states (the 200-token one from position 0: a zero state)."""
    gen = torch.Generator().manual_seed(0)
    hk, hv = 2, 4
    lengths = [1, 63, 64, 65, 200, 300]
    n, c = sum(lengths), 2 * hk * dk + hv * dv
    qkv = torch.randn(n, c, generator=gen).to(dtype).to(device)
    ba = torch.randn(n, 2 * hv, generator=gen).to(dtype).to(device)
    a_log, dt_bias = torch.linspace(-2, 1, hv), 0.3 * torch.randn(hv, generator=gen)
    state = 0.5 * torch.randn(len(lengths), hv, dk, dv, generator=gen)
    fresh = (4,)
    chunked, s_chunked = run_recurrence(qkv, ba, a_log, dt_bias, state, lengths, 10**6, device,
                                        fresh)
    seq, s_seq = run_recurrence(qkv, ba, a_log, dt_bias, state, lengths, 8, device, fresh)
    ref = Reference(len(lengths), c, 4, hv, dk, dv)
    ref.ssm[:] = state.double()
    chunks, start = [], 0
    for slot, size in enumerate(lengths):
        chunks.append((slot, 0 if slot in fresh else 1, (start, start + size)))
        start += size
    want = ref.recurrence(qkv.cpu().double(), ba.cpu().double(), a_log.double(),
                          dt_bias.double(), chunks, hk, dk, dv)
    scale = float(ref.ssm.abs().max()) + float(state.abs().max()) + 1.0
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
    bound = 2 * u * want.abs() + 64 * math.sqrt(dk * 64) * U32 * scale * math.sqrt(
        max(lengths) / 64) + u * scale
    for got in (chunked, seq):
        diff = (got.cpu().double() - want).abs()
        assert (diff <= bound).all(), float(diff.max())
    state_bound = 64 * math.sqrt(dk * max(lengths)) * U32 * scale
    for s in (s_chunked, s_seq):
        assert float((s.cpu().double() - ref.ssm).abs().max()) <= state_bound
    assert float((chunked.float() - seq.float()).abs().max()) <= float(bound.max())
