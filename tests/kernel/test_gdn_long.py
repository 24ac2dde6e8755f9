"""Long-context correctness of the CPU Gated DeltaNet kernels: 65,536 prompt tokens in prefill
chunks of 2048, then single-token decode steps, through ops.gdn_conv1d / ops.gdn_recurrence
exactly as GatedDeltaNetBlock.mix drives them (one state slot, positions telling a fresh
sequence from a continued one, qkv and ba strided column slices of one projection row), against
the delta rule run token by token in float64 (numpy, vectorised over heads).

A state snapshot taken at a chunk boundary half-way (engine/state_snapshots.py, the copy that
prefix-cache hits resume from) is restored into other slots and continued: with the same calls,
and with other chunk sizes (the CPU kernel is token by token, so the split cannot matter); the
states and outputs must be bit-identical to the uninterrupted run's.

Conventions (kernels/cpu/gdn.cc, ops.gdn_recurrence): S is [dk, dv] per value head;
  q, k L2-normed (eps 1e-6), q also scaled by dk^-1/2; beta = sigmoid(b);
  g = -exp(A_log) * softplus(a + dt_bias); S' = exp(g) S; w = beta (v - S'^T k);
  S = S' + k w^T; o = S^T q (with the updated S).

Error bound (float32 compute, unit roundoff u = 2^-24; the state is always float32 on the CPU,
the inputs and outputs are in the activation dtype, which the reference reads after the same
rounding, so that dtype's unit only enters through the output's final rounding).
Per column j of S (a dk-vector s), write |.| for the 2-norm, |k| = 1, |q| = dk^-1/2:
  the exact step is affine in s with linear part d_t (I - beta_t k_t k_t^T), whose norm is at
  most d_t <= d_max < 1 (I - beta k k^T has eigenvalues 1 and 1 - beta |k|^2 in (-1, 1], also
  for the kernel's k, normalised only up to rounding). So if the kernel's step adds a local error
  r_t to the exact step from its own state, e_t <= d_max e_{t-1} + |r_t|, and from e_0 = 0
  (a fresh sequence starts from exact zeros):   |e_t| <= max|r| / (1 - d_max)   for every t,
  whatever the length: the error saturates instead of growing with it.
  |r| to first order in u (sequential float32 sums as the kernel does them):
    k normalisation: sum of dk squares (dk u), + eps, sqrt (halves it), 1/x, product:
                     |dk_hat - k| <= c_k u with c_k = (dk + 1) / 2 + 3
    decay: x = a + dt_bias rounds (u |x|; softplus'/softplus <= 1 turns it into |x| u relative),
           exp and log1p (2u each, log1p's condition <= 1), exp(A_log) (2u), product (u):
           g relative (|x| + 7) u, so exp(g) relative c_d u with c_d = |g| (|x| + 7) + 2
    beta = 1 / (1 + exp(-b)): c_b = 4
    S' = d S: (c_d + 1) u |s|
    S'^T k: dk u |s| (gamma_dk, Cauchy-Schwarz) + c_k u |s| (k's own error)
    w = (v - S'^T k) beta: the above + (2 + c_b) u (|v| + |s|)
    S = S' + k w^T: c_k u |w| (k's error) + 2 u (|v| + |s|) (product, sum; |w|, |S| <= |v| + |s|)
  => |r| <= u (dk + 2 c_k + c_d + c_b + 5) (M_s + M_v), with M_s the largest column norm of the
  state over the run (from the reference) and M_v the largest |v|. Elementwise |e_ij| <= |e_j|.
  Outputs: o_j = q^T s_j: |q| |e_j| + (dk + c_q) u |q| M_s (the dot product and q's
  normalisation, c_q = c_k + 2 for the scale) + u_out |o| + TINY (the final rounding).
  Second-order terms (u^2 relative) and the computed-vs-exact magnitudes are covered by a 1% margin.
The conv output (K taps, sequential float32 sum, silu' <= 1.1): 1.1 K u sum|w x| + 4 u |y| +
u_out |y| (+ half the output dtype's subnormal spacing, TINY: small outputs round in absolute
terms); the conv state is a copy of the last K-1 inputs: exact.
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.arrays import Device, TorchArrays
from freetoken.engine.state_snapshots import StateSnapshots
from freetoken.kernel import ops

U32 = 2.0 ** -24
UNIT = {torch.float32: U32, torch.float16: 2.0 ** -11}
# half the subnormal spacing: the absolute error of rounding a result below the normal range
TINY = {torch.float32: 2.0 ** -150, torch.float16: 2.0 ** -25}

HK, HV, DK, DV, K = 1, 2, 32, 16, 4        # value heads grouped by key head, dk != dv
PROMPT, CHUNK, DECODE = 65536, 2048, 256
SNAP_AT = PROMPT // 2                      # a chunk boundary
CHECKPOINTS = (16384, 32768, PROMPT, PROMPT + DECODE)
C = 2 * HK * DK + HV * DV                  # conv channels: q, k, v columns


def make_inputs(dtype):
    """x (the conv input) and ba as strided column slices of one [T, C + 2 Hv + 5] projection
    row, as the model's in_proj output; gates giving a per-token decay exp(-0.01..-0.1)."""
    gen = torch.Generator().manual_seed(0)
    n = PROMPT + DECODE
    proj = torch.empty(n, C + 2 * HV + 5)
    proj[:, :C] = torch.randn(n, C, generator=gen)
    a_log = torch.tensor([math.log(0.05), math.log(0.02)])
    dt_bias = torch.tensor([0.5, -0.3])
    g_abs = 0.01 + 0.09 * torch.rand(n, HV, generator=gen)        # wanted -g per token
    sp = g_abs / a_log.exp()                                      # softplus(a + dt_bias)
    proj[:, C + HV:C + 2 * HV] = torch.log(torch.expm1(sp)) - dt_bias    # a
    proj[:, C:C + HV] = torch.randn(n, HV, generator=gen)                 # b: beta in (0, 1)
    proj = proj.to(dtype)
    weight = (0.5 * torch.randn(C, K, generator=gen)).to(dtype)
    return proj[:, :C], proj[:, C:C + 2 * HV], weight, a_log, dt_bias


class Runner:
    """The layer's two states in a pool of slots, fed call by call like GatedDeltaNetBlock."""

    def __init__(self, x, ba, weight, a_log, dt_bias, slots=3):
        self.x, self.ba, self.weight, self.a_log, self.dt_bias = x, ba, weight, a_log, dt_bias
        self.conv_state = torch.zeros(slots, C, K - 1, dtype=x.dtype)
        self.ssm_state = torch.zeros(slots, HV, DK, DV, dtype=torch.float32)
        n = x.shape[0]
        self.conv_out = torch.empty(slots, n, C, dtype=x.dtype)
        self.core = torch.empty(slots, n, HV * DV, dtype=x.dtype)
        self.states = {}          # (slot, tokens) -> ssm state copy at the checkpoints

    def call(self, slot, start, size):
        end = start + size
        positions = torch.arange(start, end, dtype=torch.int64)
        qs = torch.tensor([0, size], dtype=torch.int32)
        slots = torch.tensor([slot], dtype=torch.int32)
        conv_out = torch.empty(size, C, dtype=self.x.dtype)
        core = torch.empty(size, HV * DV, dtype=self.x.dtype)
        ops.gdn_conv1d(conv_out, self.x[start:end], self.conv_state, self.weight, positions, qs,
                       slots)
        ops.gdn_recurrence(core, conv_out, self.ba[start:end], self.a_log, self.dt_bias,
                           self.ssm_state, positions, qs, slots)
        self.conv_out[slot, start:end] = conv_out
        self.core[slot, start:end] = core
        # the conv state holds the last K-1 inputs, bit for bit
        want = self.x[end - (K - 1):end].T
        assert torch.equal(self.conv_state[slot], want), f"conv state after {end} tokens"
        if end in CHECKPOINTS:
            self.states[slot, end] = self.ssm_state[slot].clone()

    def run(self, slot, start, chunk):
        """Prefill from `start` to PROMPT in calls of `chunk` tokens (the first may be shorter,
        to reach a multiple), then the decode steps one token a call."""
        t = start
        while t < PROMPT:
            size = min(chunk - t % chunk, PROMPT - t)
            self.call(slot, t, size)
            t += size
            yield t
        for t in range(PROMPT, PROMPT + DECODE):
            self.call(slot, t, 1)


def reference(qkv, ba, a_log, dt_bias, upto, checkpoints, decay_first=True):
    """The delta rule in float64 over the kernel's conv output `qkv` (tokens [0, upto)):
    (outputs [upto, Hv, dv], {tokens: state [Hv, dk, dv]}, M_s, M_v, d_max, c_d).
    decay_first=False: a wrong convention (decay after the write), to show the check bites."""
    qkv = qkv[:upto].double().numpy()
    ba = ba[:upto].double().numpy()
    a_log, dt_bias = a_log.double().numpy(), dt_bias.double().numpy()
    group = HV // HK
    q = qkv[:, :HK * DK].reshape(-1, HK, DK)
    k = qkv[:, HK * DK:2 * HK * DK].reshape(-1, HK, DK)
    v = qkv[:, 2 * HK * DK:].reshape(-1, HV, DV)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(DK)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, group, axis=1), np.repeat(k, group, axis=1)     # per value head
    beta = 1.0 / (1.0 + np.exp(-ba[:, :HV]))
    xs = ba[:, HV:] + dt_bias
    g = -np.exp(a_log) * np.logaddexp(0.0, xs)
    decay = np.exp(g)
    c_d = float((np.abs(g) * (np.abs(xs) + 7)).max()) + 2
    s = np.zeros((HV, DK, DV))
    out = np.empty((upto, HV, DV))
    states, col_max = {}, 0.0
    k3, q3, d3 = k[:, :, :, None], q[:, :, :, None], decay[:, :, None, None]
    beta2 = beta[:, :, None]
    for t in range(upto):
        if decay_first:
            s *= d3[t]
        w = beta2[t] * (v[t] - (k3[t] * s).sum(1))
        s += k3[t] * w[:, None, :]
        if not decay_first:
            s *= d3[t]
        out[t] = (q3[t] * s).sum(1)
        col_max = max(col_max, float((s * s).sum(1).max()))   # the largest column norm^2
        if t + 1 in checkpoints:
            states[t + 1] = s.copy()
    return out, states, math.sqrt(col_max), float(np.abs(v).max()), float(decay.max()), c_d


def bounds(m_s, m_v, d_max, c_d, u_out):
    """(state bound per element, output bound = a + u_out |o|) from the derivation above."""
    c_k = (DK + 1) / 2 + 3
    c_q = c_k + 2
    c_b = 4
    r = U32 * (DK + 2 * c_k + c_d + c_b + 5) * (m_s + m_v)
    e = 1.01 * r / (1 - d_max)
    o = 1.01 * (e + (DK + c_q) * U32 * m_s) / math.sqrt(DK)
    return e, o


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_cpu_long_context_matches_float64_and_snapshots_resume_exactly(dtype):
    t0 = time.perf_counter()
    x, ba, weight, a_log, dt_bias = make_inputs(dtype)
    r = Runner(x, ba, weight, a_log, dt_bias)
    pool = SimpleNamespace(k=[r.conv_state], v=[r.ssm_state])
    snaps = StateSnapshots(pool, [0], capacity=2, arrays=TorchArrays(Device("cpu")))
    for t in r.run(0, 0, CHUNK):
        if t == SNAP_AT:
            snaps.save(b"page-key", 0)
    t_kernel = time.perf_counter() - t0

    # resume from the snapshot in slots that held other states: the same calls (slot 1), and
    # prefill calls of 1000 tokens (slot 2); both bit-identical to the uninterrupted run
    n = PROMPT + DECODE
    for slot, chunk in ((1, CHUNK), (2, 1000)):
        r.conv_state[slot].normal_()
        r.ssm_state[slot].normal_()
        snaps.restore(b"page-key", slot)
        for _ in r.run(slot, SNAP_AT, chunk):
            pass
        assert torch.equal(r.ssm_state[slot], r.ssm_state[0]), slot
        assert torch.equal(r.conv_state[slot], r.conv_state[0]), slot
        assert torch.equal(r.core[slot, SNAP_AT:], r.core[0, SNAP_AT:]), slot
        assert torch.equal(r.conv_out[slot, SNAP_AT:], r.conv_out[0, SNAP_AT:]), slot
        for tokens in CHECKPOINTS[2:]:
            assert torch.equal(r.states[slot, tokens], r.states[0, tokens]), (slot, tokens)

    # the conv output against float64
    xd, wd = x.double(), weight.double()
    pad = torch.cat([torch.zeros(K - 1, C, dtype=torch.float64), xd])
    taps = torch.stack([pad[j:j + n] * wd[:, j] for j in range(K)])          # [K, T, C]
    acc = taps.sum(0)
    y = acc * torch.sigmoid(acc)
    u_out = UNIT[dtype]
    conv_bound = 1.1 * K * U32 * taps.abs().sum(0) + (4 * U32 + u_out) * y.abs() + TINY[dtype]
    conv_err = (r.conv_out[0].double() - y).abs()
    assert (conv_err <= conv_bound).all(), f"conv output off by {float(conv_err.max()):.3g}"

    # the recurrence against float64, over the kernel's own conv output (its input)
    t1 = time.perf_counter()
    out, states, m_s, m_v, d_max, c_d = reference(r.conv_out[0], ba, a_log, dt_bias, n,
                                                  CHECKPOINTS)
    t_ref = time.perf_counter() - t1
    assert 0.9 < d_max < math.exp(-0.0099)
    state_bound, out_bound = bounds(m_s, m_v, d_max, c_d, u_out)
    report = []
    for tokens in CHECKPOINTS:
        err = (r.states[0, tokens].double().numpy() - states[tokens])
        worst = np.unravel_index(np.abs(err).argmax(), err.shape)
        report.append(f"{tokens}: {np.abs(err).max():.3g} at (h, i, j) = {tuple(map(int, worst))}")
        assert np.abs(err).max() <= state_bound, (
            f"state after {tokens} tokens off by {np.abs(err).max():.3g} at {worst} "
            f"(bound {state_bound:.3g})")
    got = r.core[0].double().numpy().reshape(n, HV, DV)
    o_err = np.abs(got - out)
    o_bound = out_bound + u_out * np.abs(out) + TINY[dtype]
    assert (o_err <= o_bound).all(), (
        f"outputs off by {o_err.max():.3g} at {np.unravel_index(o_err.argmax(), o_err.shape)}")
    # the bound is not vacuous: well below the state's size, and a wrong convention (decay
    # applied after the write) breaks it within the first 4096 tokens
    assert state_bound < 1e-2 * m_s
    early = 4096
    wrong, wrong_states, *_ = reference(r.conv_out[0], ba, a_log, dt_bias, early, (early,),
                                        decay_first=False)
    r2 = Runner(x, ba, weight, a_log, dt_bias, slots=1)
    for t in range(0, early, CHUNK):
        r2.call(0, t, CHUNK)
    assert np.abs(r2.ssm_state[0].double().numpy() - wrong_states[early]).max() > state_bound
    print(f"\n{dtype}: kernels {t_kernel:.1f}s, reference {t_ref:.1f}s, total "
          f"{time.perf_counter() - t0:.1f}s; M_s {m_s:.3g}, M_v {m_v:.3g}, d_max {d_max:.5f}; "
          f"state bound {state_bound:.3g}, output bound {out_bound:.3g}; "
          f"output err max {o_err.max():.3g}; state err " + "; ".join(report))
