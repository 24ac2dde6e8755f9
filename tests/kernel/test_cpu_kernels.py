"""cpu-x86_64 kernels against the plain-torch references, through the real loader path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.kernel import reference as ref
from freetoken.kernel.loader import get_function
from tests.kernel.gated_norm_check import check_gated_norm
from tests.tolerances import assert_close, bound

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = ("scalar", "avx2", "avx512")


def close(out, want, dtype, terms: int = 1, magnitude=None):
    """The kernels and the references both compute in float32 from the same inputs and round
    to `dtype` once: float32 rounding over `terms` accumulated values, then one ulp of dtype."""
    assert_close(out, want, dtype, compute=torch.float32, terms=terms, magnitude=magnitude)


def dot_magnitude(x, w):
    """sum_j |x_ij w_kj|: what the rounding error of each entry of x @ w.T scales with."""
    return x.abs().double() @ w.abs().double().T


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def supported_isas() -> tuple[str, ...]:
    return ISAS[: ISAS.index(ops.cpu_isa()) + 1]


# ------------------------------------------------------------------ norms and elementwise ops

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 64), (3, 576), (17, 100)])
def test_rms_norm(dtype, t, d):
    x, w = randn(t, d, dtype=dtype, seed=1), randn(d, dtype=dtype, seed=2)
    out, want = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    ref.rms_norm(want, x, w, 1e-5)
    close(out, want, dtype, terms=d)


def test_rms_norm_strided_rows_and_heads():
    wide = randn(5, 3 * 64, seed=3)
    x = wide[:, 64:128]                        # rows 192 apart, as a slice of a fused output
    heads = randn(5, 4, 64, seed=4)            # per-head norm over [T, H, D]
    w = randn(64, seed=5)
    for inp in (x, heads):
        out, want = torch.empty(inp.shape), torch.empty(inp.shape)
        ops.rms_norm(out, inp, w, 1e-6)
        ref.rms_norm(want, inp, w, 1e-6)
        close(out, want, torch.float32, terms=64)
    # per-head norm in place on the q heads of a fused qkv row (Qwen3): token stride 512, head 64
    qkv = randn(5, 8 * 64, seed=6)
    q_heads = qkv[:, : 4 * 64].view(5, 4, 64)
    want = torch.empty(5, 4, 64)
    ref.rms_norm(want, q_heads.clone(), w, 1e-6)
    untouched = qkv[:, 4 * 64:].clone()
    ops.rms_norm(q_heads, q_heads, w, 1e-6)
    close(q_heads, want, torch.float32, terms=64)
    assert torch.equal(qkv[:, 4 * 64:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,groups,width", [(1, 4, 32), (3, 2, 128), (5, 3, 20)])
def test_rms_norm_gated(dtype, t, groups, width):
    check_gated_norm("cpu", dtype, t, groups, width, ulps=8)


def test_rms_norm_gated_refuses_a_weight_that_does_not_divide_the_rows():
    x = torch.randn(2, 96)
    with pytest.raises(Exception, match="divides"):
        ops.rms_norm_gated(x, x, x.clone(), torch.randn(40), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 576), (17, 100)])
def test_fused_add_rms_norm(dtype, t, d):
    x, res, w = randn(t, d, dtype=dtype, seed=6), randn(t, d, dtype=dtype, seed=7), randn(d, dtype=dtype, seed=8)
    x2, res2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref.fused_add_rms_norm(x2, res2, w, 1e-5)
    close(res, res2, dtype)
    close(x, x2, dtype, terms=d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot", [64, 32, 20, 6])  # half of 20 and 6: vector tails of 2 and 3
@pytest.mark.parametrize("t", [1, 3, 17])
def test_rotary_embedding(dtype, is_neox, rot, t):
    hq, hk, d, max_pos = 9, 3, 64, 100
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (t,), generator=torch.Generator().manual_seed(t))
    qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=9)
    q, k = qkv[:, : hq * d], qkv[:, hq * d: (hq + hk) * d]  # strided views, as the model has them
    q2, k2 = q.clone(), k.clone().view(t, hk, d)           # and a 3-D k for the reference copy
    ops.rotary_embedding(positions, q, k, cache, d, is_neox)
    ref.rotary_embedding(positions, q2, k2, cache, d, is_neox)
    close(q, q2, dtype, terms=2)
    close(k, k2.view(t, hk * d), dtype, terms=2)
    if rot < d:  # the unrotated tail is untouched
        untouched = qkv.view(t, -1, d)[:, :hq, rot:]
        assert torch.equal(untouched, randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=9).view(t, -1, d)[:, :hq, rot:])


@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", [(1, 1536), (3, 100), (17, 64), (2, 5), (1, 1539)])
def test_gated_activations(op, dtype, t, d):
    x = randn(t, 2 * d, dtype=dtype, seed=10, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -20.0]).to(dtype)  # saturating ends of exp
    out, want = torch.empty(t, d, dtype=dtype), torch.empty(t, d, dtype=dtype)
    getattr(ops, op)(out, x)
    getattr(ref, op)(want, x)
    close(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_on_strided_rows(dtype):
    """Rows a fixed stride apart (slices of a wider buffer), widths with vector tails."""
    wide = randn(4, 3 * 104, dtype=dtype, seed=11, scale=3.0)
    x = wide[:, 13:13 + 2 * 45]                       # silu input: rows 312 apart, d = 45
    out_wide = torch.zeros(4, 100, dtype=dtype)
    out = out_wide[:, 7:52]                           # strided output rows
    want = torch.empty(4, 45, dtype=dtype)
    ops.silu_and_mul(out, x)
    ref.silu_and_mul(want, x.contiguous())
    close(out, want, dtype)
    assert not out_wide[:, :7].any() and not out_wide[:, 52:].any()
    h, res = wide[:, 200:299], randn(4, 99, dtype=dtype, seed=12)  # d = 99, x rows strided
    w = randn(99, dtype=dtype, seed=13)
    h2, res2 = h.clone(), res.clone()
    ops.fused_add_rms_norm(h, res, w, 1e-5)
    ref.fused_add_rms_norm(h2, res2, w, 1e-5)
    close(res, res2, dtype)
    close(h, h2, dtype, terms=99)
    normed, want = torch.empty(4, 99, dtype=dtype), torch.empty(4, 99, dtype=dtype)
    ops.rms_norm(normed, wide[:, 1:100], w, 1e-5)
    ref.rms_norm(want, wide[:, 1:100].contiguous(), w, 1e-5)
    close(normed, want, dtype, terms=99)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [5, 13])
def test_norms_narrower_than_a_vector(dtype, d):
    x, res = randn(3, d, dtype=dtype, seed=14), randn(3, d, dtype=dtype, seed=15)
    w = randn(d, dtype=dtype, seed=16)
    out, want = torch.empty_like(x), torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    ref.rms_norm(want, x, w, 1e-5)
    close(out, want, dtype, terms=d)
    x2, res2 = x.clone(), res.clone()
    ops.fused_add_rms_norm(x, res, w, 1e-5)
    ref.fused_add_rms_norm(x2, res2, w, 1e-5)
    close(x, x2, dtype, terms=d)


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_store_kv(src_dtype, cache_dtype):
    t, hk, d, slots = 5, 3, 64, 40
    k, v = randn(t, hk, d, dtype=src_dtype, seed=11), randn(t, hk, d, dtype=src_dtype, seed=12)
    slot_mapping = torch.tensor([7, -1, 39, 0, 16])
    caches = [randn(slots, hk, d, dtype=cache_dtype, seed=s) for s in (13, 14)]
    wants = [c.clone() for c in caches]
    ops.store_kv(k, v, caches[0], caches[1], slot_mapping)
    ref.store_kv(k, v, wants[0], wants[1], slot_mapping)
    assert torch.equal(caches[0], wants[0]) and torch.equal(caches[1], wants[1])


def test_embedding_rows_and_exact_conversions():
    specials = [0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e-8, 2.9802322e-08, 5.9604645e-08,
                6.1e-5, 1.00048828125, 1.0009765625 + 2**-11, 3.0e38, float("inf"), float("-inf"),
                float("nan"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.5e-7, 3.4e-5]
    table = torch.cat([torch.tensor(specials), randn(64 * 7 - len(specials), seed=15, scale=100)])
    table = table.view(7, 64)
    ids = torch.tensor([6, 0, 3, 3, 1])
    for out_dtype in DTYPES:
        out = torch.empty(5, 64, dtype=out_dtype)
        ops.embedding(out, ids, table)
        want = table[ids].to(out_dtype)  # torch rounds to nearest even: the kernels must match bits
        assert torch.equal(out.isnan(), want.isnan())
        bits = torch.int16 if out_dtype != torch.float32 else torch.int32
        assert torch.equal(out.view(bits)[~want.isnan()], want.view(bits)[~want.isnan()])
    for table_dtype in (torch.float16, torch.bfloat16):
        half_table = table.to(table_dtype)
        out = torch.empty(5, 64)
        ops.embedding(out, ids, half_table)
        assert torch.equal(out.nan_to_num(7.0), half_table[ids].float().nan_to_num(7.0))


# ------------------------------------------------------------------ attention

def make_attention_case(q_lens, seq_lens, hq, hk, d, block_size, q_dtype, cache_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)  # scattered blocks
    max_blocks = max(pages) + 1
    block_tables = torch.full((len(seq_lens), max_blocks), 10**6, dtype=torch.int32)  # unused: never read
    used = 0
    for b, n in enumerate(pages):
        block_tables[b, :n] = perm[used: used + n]
        used += n
    slots = num_blocks * block_size
    k_cache = torch.randn(slots, hk, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(slots, hk, d, generator=g).to(cache_dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=g).to(q_dtype)
    qsl = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl


MIXED = ([1, 5, 17, 0, 1, 70], [9, 5, 40, 7, 33, 150])  # decode, fresh prefill, chunk, idle, long


@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 100), (8, 1, 64)])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32),
                                                 (torch.float32, torch.float16),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float16)])
@pytest.mark.parametrize("window", [0, 7])
def test_paged_attention_mixed_batch(hq, hk, d, q_dtype, cache_dtype, window):
    q, kc, vc, bt, sl, qsl = make_attention_case(*MIXED, hq, hk, d, 16, q_dtype, cache_dtype, seed=hq + d)
    out = torch.full(q.shape, float("nan"), dtype=q_dtype)
    want = torch.empty_like(out)
    ops.paged_attention(out, q, kc, vc, bt, sl, qsl, 16, d ** -0.5, window)
    ref.paged_attention(want, q, kc, vc, bt, sl, qsl, 16, d ** -0.5, window)
    # |out| <= max |v| (a convex mix of V rows); softmax sums up to 150 keys, dots d dims
    close(out, want, q_dtype, terms=max(MIXED[1]) + d, magnitude=vc.float().abs().max())


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("context", [1, 64, 300])
def test_paged_attention_decode(batch, context):
    seq_lens = [context + 3 * b for b in range(batch)]
    q, kc, vc, bt, sl, qsl = make_attention_case([1] * batch, seq_lens, 9, 3, 64, 16,
                                                 torch.float32, torch.float32, seed=context)
    out, want = torch.empty_like(q), torch.empty_like(q)
    ops.paged_attention(out, q, kc, vc, bt, sl, qsl, 16, 0.125)
    ref.paged_attention(want, q, kc, vc, bt, sl, qsl, 16, 0.125)
    close(out, want, torch.float32, terms=max(seq_lens) + 64, magnitude=vc.abs().max())


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 300])
def test_paged_attention_split_key_ranges(cache_dtype, window):
    # one sequence, few tasks: the key range is split over the cores and merged (head dim 128)
    q, kc, vc, bt, sl, qsl = make_attention_case([3], [400], 8, 2, 128, 16, torch.float32,
                                                 cache_dtype, seed=7)
    out, want = torch.empty_like(q), torch.empty_like(q)
    ops.paged_attention(out, q, kc, vc, bt, sl, qsl, 16, 128 ** -0.5, window)
    ref.paged_attention(want, q, kc, vc, bt, sl, qsl, 16, 128 ** -0.5, window)
    close(out, want, torch.float32, terms=400 + 128, magnitude=vc.float().abs().max())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("context", [40, 700, 1500])
def test_paged_attention_rows_do_not_depend_on_the_rest_of_the_call(cache_dtype, window, context):
    """A token's output is the same bits whether it is decoded alone (few tasks: the key
    range split over the cores), verified with a few more tokens of its sequence (speculative
    decoding) or part of a prefill chunk beside other sequences (speculative decoding's
    greedy output equals plain decoding only so)."""
    hq, hk, d = 8, 2, 128
    # the sequence's last 6 tokens as one chunk, beside two other sequences
    q, kc, vc, bt, sl, qsl = make_attention_case([6, 40, 1], [context, 90, 300], hq, hk, d, 16,
                                                 torch.float32, cache_dtype, seed=context)
    scale = d ** -0.5
    together = torch.empty_like(q)
    ops.paged_attention(together, q, kc, vc, bt, sl, qsl, 16, scale, window)
    for i in range(6):   # token i of the chunk alone, and with the chunk's later tokens
        for count in (1, 2, 6 - i):
            rows = q[i:i + count].contiguous()
            alone = torch.empty_like(rows)
            ops.paged_attention(alone, rows, kc, vc, bt[:1].contiguous(),
                                torch.tensor([context - 6 + i + count], dtype=torch.int32),
                                torch.tensor([0, count], dtype=torch.int32), 16, scale, window)
            assert torch.equal(alone[0], together[i]), (i, count)


def test_paged_attention_strided_q_from_fused_projection():
    q, kc, vc, bt, sl, qsl = make_attention_case([3, 1], [3, 20], 4, 2, 64, 16,
                                                 torch.float32, torch.float32, seed=5)
    qkv = torch.cat([q.view(4, -1), torch.zeros(4, 2 * 2 * 64)], dim=1)
    q_view = qkv[:, : 4 * 64].view(4, 4, 64)  # token stride 512, heads contiguous
    out, want = torch.empty_like(q), torch.empty_like(q)
    ops.paged_attention(out, q_view, kc, vc, bt, sl, qsl, 16, 0.125)
    ref.paged_attention(want, q, kc, vc, bt, sl, qsl, 16, 0.125)
    close(out, want, torch.float32, terms=20 + 64, magnitude=vc.abs().max())


# ------------------------------------------------------------------ quantized matmul

QTYPES = (ref.Q4_0, ref.Q4_1, ref.Q8_0)
# (M, K, N); (1, 64, 1030): decode chunks long enough to prefetch ahead, plus tail rows
SHAPES = [(1, 32, 8), (1, 576, 67), (3, 96, 13), (5, 288, 9), (17, 1536, 40), (1, 64, 1030)]


def quant_case(m, k, n, qtype, seed):
    w = randn(n, k, seed=seed)
    return ref.quantize(w, qtype), randn(m, k, seed=seed + 1)


def assert_within_activation_rounding(out, x, w):
    """x is rounded to int8 per 32-block (step = max|x| / 127): each output may move by at most
    sum_j |w_j| * step_j / 2, plus float rounding."""
    step = x.abs().view(x.shape[0], -1, 32).amax(-1, keepdim=True) / 127
    quant_bound = (step / 2).expand(-1, -1, 32).reshape(x.shape) @ w.abs().T
    want = x @ w.T
    rounding = torch.from_numpy(bound(torch.float32, dot_magnitude(x, w), terms=x.shape[1])).float()
    excess = (out - want).abs() - (quant_bound + rounding)
    assert excess.max() <= 0, f"worst excess over the int8 rounding bound: {excess.max():.3g}"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_quant_matmul_within_8bit_activation_error(qtype, m, k, n):
    qw, x = quant_case(m, k, n, qtype, seed=m + k + n)
    out, want = torch.empty(m, n), torch.empty(m, n)
    ops.quant_matmul(out, x, qw, qtype)
    ref.quant_matmul(want, x, qw, qtype)
    assert_within_activation_rounding(out, x, ref.dequantize(qw, qtype))
    assert (out - want).norm() <= 2e-2 * want.norm()  # in practice ~0.5% of the output norm


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_quant_matmul_each_isa_exact_when_activations_are_int8(isa, qtype, m, k, n):
    if isa not in supported_isas():
        pytest.skip(f"this CPU has no {isa} (best: {ops.cpu_isa()})")
    qw, _ = quant_case(m, k, n, qtype, seed=m * n)
    # every 32-block holds integers with max |x| = 127: quantizing x to int8 is then exact
    x = torch.randint(-127, 128, (m, k), generator=torch.Generator().manual_seed(k)).float()
    x.view(m, -1, 32)[:, :, 5] = 127.0
    out, want = torch.empty(m, n), torch.empty(m, n)
    get_function("quant_gemm", "quant_matmul_isa", "cpu")(out, x, qw, qtype, isa)
    ref.quant_matmul(want, x, qw, qtype)
    close(out, want, torch.float32, terms=k, magnitude=dot_magnitude(x, ref.dequantize(qw, qtype)))


def test_quant_matmul_isas_agree_and_threads_do_not_change_results():
    qw, x = quant_case(7, 576, 300, ref.Q4_1, seed=3)
    run = get_function("quant_gemm", "quant_matmul_isa", "cpu")
    set_threads = get_function("quant_gemm", "set_num_threads", "cpu")
    outs = {}
    for isa in supported_isas():
        outs[isa] = torch.empty(7, 300)
        run(outs[isa], x, qw, ref.Q4_1, isa)
    magnitude = dot_magnitude(x, ref.dequantize(qw, ref.Q4_1))
    for isa, out in outs.items():
        close(out, outs["scalar"], torch.float32, terms=576, magnitude=magnitude)
    assert set_threads(1) == 1
    single = torch.empty(7, 300)
    ops.quant_matmul(single, x, qw, ref.Q4_1)
    assert set_threads(0) >= 1
    multi = torch.empty(7, 300)
    ops.quant_matmul(multi, x, qw, ref.Q4_1)
    assert torch.equal(single, multi)


def test_quant_matmul_in_a_forked_child():
    import os

    qw, x = quant_case(3, 64, 256, ref.Q4_1, seed=4)
    parent = torch.empty(3, 256)
    ops.quant_matmul(parent, x, qw, ref.Q4_1)  # the pool exists before the fork
    pid = os.fork()
    if pid == 0:  # the child restarts its own workers
        child = torch.empty(3, 256)
        for _ in range(20):
            ops.quant_matmul(child, x, qw, ref.Q4_1)
        os._exit(0 if torch.equal(child, parent) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf_package(qtype):
    import gguf

    w = randn(6, 128, seed=qtype).numpy()
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)))
    qw = torch.from_numpy(np.ascontiguousarray(blocks))
    torch.testing.assert_close(ref.dequantize(qw, qtype), want, rtol=0, atol=0)
    ids = torch.tensor([5, 0, 2, 2])
    out = torch.empty(4, 128)
    ops.dequantize_rows(out, ids, qw, qtype)
    torch.testing.assert_close(out, want[ids], rtol=0, atol=0)
    x = randn(2, 128, seed=9)
    got = torch.empty(2, 6)
    ops.quant_matmul(got, x, qw, qtype)
    assert_within_activation_rounding(got, x, want)


def test_cpu_isa_is_known():
    assert ops.cpu_isa() in ISAS


# ------------------------------------------------------------------ bad input

def raises(match):
    return pytest.raises(RuntimeError, match=match)


def test_bad_inputs_raise_clear_errors():
    x, w = torch.randn(2, 64), torch.randn(64)
    with raises("x must be float32, bfloat16 or float16, got int64"):
        ops.rms_norm(torch.empty(2, 64), torch.zeros(2, 64, dtype=torch.int64), w, 1e-5)
    with raises("weight must be"):
        ops.rms_norm(torch.empty(2, 64), x, torch.randn(63), 1e-5)
    with raises("out and x must have the same shape"):
        ops.rms_norm(torch.empty(3, 64), x, w, 1e-5)
    with raises("token id 70000 .* vocabulary of size 100"):
        ops.embedding(torch.empty(2, 8), torch.tensor([1, 70000]), torch.randn(100, 8))
    kv = torch.randn(2, 1, 8)
    with raises(r"slot_mapping\[1\] = 40 is outside the KV pool \(40 slots\)"):
        ops.store_kv(kv, kv, torch.zeros(40, 1, 8), torch.zeros(40, 1, 8), torch.tensor([0, 40]))
    with raises("positions"):
        ops.rotary_embedding(torch.tensor([5]), torch.randn(1, 64), torch.randn(1, 64),
                             torch.randn(4, 64), 64, True)
    with raises("last dim must be even"):
        ops.silu_and_mul(torch.empty(1, 3), torch.randn(1, 7))


def test_bad_attention_and_quant_inputs_raise():
    q, kc, vc, bt, sl, qsl = make_attention_case([1], [20], 4, 2, 64, 16,
                                                 torch.float32, torch.float32, seed=1)
    bt[0, 1] = 999
    with raises(r"block_tables\[0, 1\] = 999 is outside"):
        ops.paged_attention(torch.empty_like(q), q, kc, vc, bt, sl, qsl, 16, 0.1)
    with raises("multiple of KV heads"):
        ops.paged_attention(torch.empty(1, 3, 64), torch.randn(1, 3, 64), kc, vc, bt, sl, qsl, 16, 0.1)
    qw = ref.quantize(torch.randn(4, 64), ref.Q4_1)
    with raises("qweight rows hold 40 bytes but K = 96 needs 60"):
        ops.quant_matmul(torch.empty(1, 4), torch.randn(1, 96), qw, ref.Q4_1)
    with raises("qtype 10 is not supported"):     # Q2_K: not read on the CPU
        ops.quant_matmul(torch.empty(1, 4), torch.randn(1, 64), qw, 10)
    with raises("x must be float32"):
        ops.quant_matmul(torch.empty(1, 4), torch.randn(1, 64, dtype=torch.float16), qw, ref.Q4_1)
    with raises("unknown isa 'sse9'"):
        get_function("quant_gemm", "quant_matmul_isa", "cpu")(torch.empty(1, 4), torch.randn(1, 64), qw, ref.Q4_1, "sse9")
    if "avx512" not in supported_isas():
        with raises("not supported by this CPU"):
            get_function("quant_gemm", "quant_matmul_isa", "cpu")(torch.empty(1, 4), torch.randn(1, 64), qw, ref.Q4_1, "avx512")
    with raises(r"id 9 \(ids\[0\]\) is outside qweight's 4 rows"):
        ops.dequantize_rows(torch.empty(1, 64), torch.tensor([9]), qw, ref.Q4_1)
