"""GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K rows packed 16 wide for AVX-512 VNNI (quant_pack,
quant_matmul_packed, moe_experts_quant_packed):
the layout against a numpy restatement of quant_packed.h, the product against the `gguf`
package's dequantizer, and bad input refused. Skipped on a CPU without AVX-512 VNNI, where
nothing is packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function
from tests.kernel import gguf_blocks as gb
from tests.tolerances import assert_close

pytestmark = pytest.mark.skipif(ops.cpu_isa() != "avx512",
                                reason="packed weights need AVX-512 VNNI")

TYPES = (gb.Q4_0, gb.Q4_1, gb.Q5_0, gb.Q5_1, gb.Q8_0, gb.Q4_K, gb.Q6_K)
# (M, K, N): decode (one tile; many tiles, so chunks prefetch into the next), verify steps of
# up to 8 rows streamed the same way (a tile's first pass prefetches), prefill tiles of four
# activation rows plus each remainder
SHAPES = [(1, 32, 16), (1, 576, 960), (1, 64, 2048), (2, 96, 32), (3, 288, 48), (4, 64, 16),
          (5, 576, 960), (8, 64, 2048), (9, 1536, 64)]
# K-quants: K a multiple of 256; Q6_K's prefill takes activation rows two at a time
K_SHAPES = [(1, 256, 16), (1, 512, 960), (1, 256, 2048), (2, 768, 32), (3, 256, 48),
            (4, 512, 16), (5, 512, 960), (7, 256, 2048), (9, 1536, 64),
            (37, 512, 48)]   # 37 rows: quantized on the pool
CASES = [(q, *shape) for q in TYPES for shape in (K_SHAPES if q in (gb.Q4_K, gb.Q6_K) else SHAPES)]


def _words(part: np.ndarray) -> np.ndarray:
    """[t, b, n, bytes] -> the words of every row side by side: [t, b, word, n, 4] flattened."""
    t, b, n, nbytes = part.shape
    return part.reshape(t, b, n, nbytes // 4, 4).transpose(0, 1, 3, 2, 4).reshape(t, b, -1)


def _halves(part: np.ndarray) -> np.ndarray:
    """[t, b, n, 2] f16 bytes -> the 16 rows' halves in row order: [t, b, 32]."""
    return part.reshape(*part.shape[:2], -1)


def _k4_words(scales: np.ndarray) -> np.ndarray:
    """Q4_K's 12 scale bytes [t, b, n, 12] -> the three words of quant_packed.h, [t, b, 192]."""
    q = scales.astype(np.uint32)
    low = np.zeros(q.shape[:3], np.uint32)
    mins, high = low.copy(), low.copy()
    for j in range(8):
        if j < 4:
            sc, m = q[..., j] & 63, q[..., j + 4] & 63
        else:
            sc = (q[..., j + 4] & 0xF) | ((q[..., j - 4] >> 6) << 4)
            m = (q[..., j + 4] >> 4) | ((q[..., j] >> 6) << 4)
        low |= (sc & 0xF) << (4 * j)
        mins |= (m & 0xF) << (4 * j)
        high |= (sc >> 4) << (2 * j) | (m >> 4) << (16 + 2 * j)
    return np.concatenate([w.astype("<u4").view(np.uint8) for w in (low, mins, high)], axis=-1)


def numpy_pack(rows: np.ndarray, qtype: int) -> np.ndarray:
    """The packed layout as quant_packed.h describes it, restated with numpy."""
    n, row_bytes = rows.shape
    bb = gb.block_bytes(qtype)[1]
    blocks = rows.reshape(n // 16, 16, row_bytes // bb, bb).transpose(0, 2, 1, 3)  # [t, b, n, bb]
    lead = blocks.shape[:2]
    if qtype == gb.Q4_K:
        parts = [_halves(blocks[..., 0:2]), _halves(blocks[..., 2:4]), _k4_words(blocks[..., 4:16]),
                 _words(blocks[..., 16:])]
    elif qtype == gb.Q6_K:
        scales = blocks[..., 192:208].transpose(0, 1, 3, 2).reshape(*lead, -1)   # [k][n]
        parts = [_halves(blocks[..., 208:210]), scales, _words(blocks[..., :128]),
                 _words(blocks[..., 128:192])]
    else:
        heads = 2 if qtype in (gb.Q4_1, gb.Q5_1) else 1
        fifth = 4 if qtype in (gb.Q5_0, gb.Q5_1) else 0
        parts = [np.concatenate([_halves(blocks[..., 2 * h:2 * h + 2]) for h in range(heads)], -1)]
        if fifth:
            high = np.ascontiguousarray(blocks[..., 2 * heads:2 * heads + 4]).view("<u4")[..., 0]
            masks = np.zeros((*lead, 8), dtype=np.uint64)
            for j, first in enumerate([0, 4, 8, 12, 16, 20, 24, 28]):
                nibbles = ((high >> first) & 0xF).astype(np.uint64)       # [t, b, 16 rows]
                masks[..., j] = (nibbles << (4 * np.arange(16, dtype=np.uint64))).sum(-1)
            parts.append(masks.astype("<u8").view(np.uint8).reshape(*lead, 64))
        words = _words(blocks[..., 2 * heads + fifth:])
        parts.append(words ^ 0x80 if qtype == gb.Q8_0 else words)
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(n, row_bytes))


def int8_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Integers with max |x| = 127 in every 32-block: the kernel's int8 rounding is exact."""
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(seed)).float()
    x.view(m, -1, 32)[:, :, 5] = 127.0
    return x


def packed(rows: np.ndarray, qtype: int) -> torch.Tensor:
    out = torch.empty(rows.shape, dtype=torch.uint8)
    ops.quant_pack(out, torch.from_numpy(rows), qtype)
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_pack_writes_the_documented_layout(qtype):
    rows = gb.random_rows(48, 512 if qtype in (gb.Q4_K, gb.Q6_K) else 96, qtype, seed=qtype)
    assert np.array_equal(packed(rows, qtype).numpy(), numpy_pack(rows, qtype))


@pytest.mark.parametrize("qtype,m,k,n", CASES)
def test_packed_matmul_against_gguf_dequantize(qtype, m, k, n):
    rows = gb.random_rows(n, k, qtype, seed=m * k + n + qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    x = int8_activations(m, k, seed=k + qtype)
    out = torch.full((m, n), float("nan"))
    ops.quant_matmul_packed(out, x, packed(rows, qtype), qtype)
    # float32 accumulation over K products of exact integers and f16-derived scales
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, x.double().numpy() @ w.T, torch.float32, magnitude=magnitude, terms=k)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_matches_gguf_layout_on_real_activations(qtype):
    """Both layouts quantize x the same way, so they differ only in float summation order."""
    m, k, n = 5, 512 if qtype in (gb.Q4_K, gb.Q6_K) else 576, 64
    rows = gb.random_rows(n, k, qtype, seed=7 + qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(qtype))
    out, want = torch.empty(m, n), torch.empty(m, n)
    ops.quant_matmul_packed(out, x, packed(rows, qtype), qtype)
    ops.quant_matmul(want, x, torch.from_numpy(rows), qtype)
    w = gb.dequantize(rows, qtype).astype(np.float64)
    magnitude = np.abs(x.double().numpy()) @ np.abs(w).T
    assert_close(out, want, torch.float32, magnitude=magnitude, terms=k)


def test_packed_threads_do_not_change_results():
    rows = gb.random_rows(512, 576, gb.Q4_1, seed=3)
    w = packed(rows, gb.Q4_1)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(3))
    set_threads = get_function("quant_gemm", "set_num_threads", "cpu")
    outs = []
    for threads in (1, 0):
        set_threads(threads)
        outs.append(torch.empty(1, 512))
        ops.quant_matmul_packed(outs[-1], x, w, gb.Q4_1)
    assert torch.equal(outs[0], outs[1])


def test_pack_refuses_bad_input():
    rows = torch.from_numpy(gb.random_rows(24, 64, gb.Q4_1, seed=1))
    with pytest.raises(Exception, match="multiple of 16 rows"):
        ops.quant_pack(torch.empty_like(rows), rows, gb.Q4_1)
    k_rows = torch.from_numpy(gb.random_rows(16, 256, gb.Q5_K, seed=1))
    with pytest.raises(Exception, match="no packed layout"):
        ops.quant_pack(torch.empty_like(k_rows), k_rows, gb.Q5_K)
    rows = rows[:16].contiguous()
    with pytest.raises(Exception, match="in place"):
        ops.quant_pack(rows, rows, gb.Q4_1)
    with pytest.raises(Exception, match="shape"):
        ops.quant_pack(torch.empty(16, 20, dtype=torch.uint8), rows, gb.Q4_1)
    with pytest.raises(Exception, match="multiple of 16 rows"):
        ops.quant_matmul_packed(torch.empty(1, 24), torch.randn(1, 64),
                                torch.from_numpy(gb.random_rows(24, 64, gb.Q4_1, seed=2)), gb.Q4_1)


# ------------------------------------------------------------------ routed experts

def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("q13,q2", [(gb.Q4_0, gb.Q8_0), (gb.Q4_1, gb.Q5_0), (gb.Q5_1, gb.Q6_K),
                                    (gb.Q4_K, gb.Q4_K), (gb.Q6_K, gb.Q5_K)])
@pytest.mark.parametrize("t", [1, 5, 12])   # 12 tokens: activations quantized on the pool
def test_packed_experts_against_gguf_dequantize(q13, q2, t):
    """moe_experts_quant_packed with each packable tensor packed (a Q5_K one stays as
    stored) against float64 over the dequantized experts, allowing the int8 rounding of act."""
    e, k, h, i = 6, 2, 256, 256
    g = np.random.default_rng(q13 * 31 + q2 + t)
    rows13 = gb.random_rows(2 * i, h, q13, seed=q13, lead=(e,))
    rows2 = gb.random_rows(h, i, q2, seed=q2 + 100, lead=(e,))
    w13 = gb.dequantize(rows13, q13).astype(np.float64)
    w2 = gb.dequantize(rows2, q2).astype(np.float64)
    packed13, packed2 = q13 in TYPES, q2 in TYPES
    if packed13:
        rows13 = packed(rows13.reshape(-1, rows13.shape[-1]), q13).numpy().reshape(rows13.shape)
    if packed2:
        rows2 = packed(rows2.reshape(-1, rows2.shape[-1]), q2).numpy().reshape(rows2.shape)
    ids = np.stack([g.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    weights = g.uniform(0.1, 1.0, size=(t, k)).astype(np.float32)
    x = int8_activations(t, h, seed=3).numpy() / 127.0   # int8-exact per 32-block
    out = torch.full((t, h), float("nan"))
    ops.moe_experts_quant_packed(
        out, torch.from_numpy(x), torch.from_numpy(rows13), torch.from_numpy(rows2), q13, q2,
        packed13, packed2, torch.from_numpy(ids), torch.from_numpy(weights),
        torch.from_numpy(np.arange(e, dtype=np.int32)), torch.empty(0, dtype=torch.uint8))
    group = 256 if q2 in (gb.Q4_K, gb.Q5_K, gb.Q6_K) else 32   # weights per int8 scale of act
    eps = float(torch.finfo(torch.float32).eps)
    want, allowed = np.zeros((t, h)), np.zeros((t, h))
    for r in range(t):
        for j in range(k):
            ex = ids[r, j]
            gate, up = w13[ex, :i] @ x[r], w13[ex, i:] @ x[r]
            act = _silu(gate) * up
            step = np.abs(act.reshape(-1, group)).max(-1, keepdims=True) / 127
            half = np.broadcast_to(step / 2, (i // group, group)).reshape(i)
            mag = np.abs(w13[ex]) @ np.abs(x[r])
            act_err = (1.1 * 16 * eps * mag[:i] * np.abs(up)
                       + np.abs(_silu(gate)) * 16 * eps * mag[i:])
            want[r] += weights[r, j] * (w2[ex] @ act)
            allowed[r] += weights[r, j] * (np.abs(w2[ex]) @ (half + act_err + np.abs(act) * 1e-6))
    allowed += 8 * eps * np.sqrt(i) * np.abs(want).max()
    excess = np.abs(out.double().numpy() - want) - allowed
    assert excess.max() <= 0, f"worst excess over the bound: {excess.max():.3g}"


def test_packed_experts_refuse_what_cannot_be_packed():
    e, h, i = 2, 64, 40     # I = 40: a gate/up task of 32 rows would end mid-tile
    rows13 = torch.from_numpy(gb.random_rows(2 * i, h, gb.Q8_0, seed=1, lead=(e,)))
    rows2 = torch.from_numpy(gb.random_rows(h, 64, gb.Q8_0, seed=2, lead=(e,)))
    routing = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1),
               torch.arange(e, dtype=torch.int32), torch.empty(0, dtype=torch.uint8))
    with pytest.raises(Exception, match="I to be a multiple of 16"):
        ops.moe_experts_quant_packed(torch.empty(1, h), torch.randn(1, h), rows13, rows2,
                                     gb.Q8_0, gb.Q8_0, True, False, *routing)
    with pytest.raises(Exception, match="qtype2 = 13 has no packed layout"):
        ops.moe_experts_quant_packed(torch.empty(1, h), torch.randn(1, h), rows13, rows2,
                                     gb.Q8_0, gb.Q5_K, False, True, *routing)
