"""The FP8 KV pool's CUDA kernels (store_kv_fp8, paged_attention_fp8, rope_store_kv_fp8)
against the plain-torch references: the writers against torch's float8 conversion of the same
rows, attention against the reference over the SAME quantized pool."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.kernel import ops, reference
from tests.tolerances import assert_close

WORKSPACE_FLOATS = 1 << 20
# A row whose values divided by its scale (1: its largest magnitude is 448) are exact, with ties
# of e4m3 neighbours among them: round to nearest even -> these codes (what the CPU writer and
# torch store too).
TIE_ROW = [448.0, 1.0625, 1.1875, 2.0 ** -10, 3 * 2.0 ** -10, -1.0625, 0.0, -448.0]
TIE_CODES = [0x7E, 0x38, 0x3A, 0x00, 0x02, 0xB8, 0x00, 0xFE]


def gpu(fn):
    """Mark a test as needing a CUDA GPU; it skips cleanly without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _random_pool(slots, heads, d, gen):
    """Codes (no NaN code) and scales to start from: slots nobody writes must keep them."""
    codes = torch.randint(0, 0x7F, (slots, heads, d), dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=gen) << 7
    return codes, torch.rand(slots, heads, generator=gen) + 0.5


def _e4m3(codes):
    return codes.view(torch.float8_e4m3fn).float()


def _check_fp8_rows(codes, scales, want_codes, want_scales, ratio):
    """A writer's rows against the reference's: scales within one float32 ulp (both positive,
    so their bit patterns are ordered); codes equal, except that where the reference's x / scale
    (`ratio`) lies within two float32 ulps of a tie of two neighbouring e4m3 values, either
    neighbour is right (a one-ulp different scale or quotient may cross the tie)."""
    step = (scales.view(torch.int32).long() - want_scales.view(torch.int32).long()).abs()
    assert step.max().item() <= 1, f"scales differ by {step.max().item()} ulps"
    differ = codes != want_codes
    if not differ.any():
        return
    a, b, r = codes[differ], want_codes[differ], ratio.expand(codes.shape)[differ]
    same_sign = ((a ^ b) & 0x80) == 0
    neighbours = same_sign & (((a & 0x7F).int() - (b & 0x7F).int()).abs() == 1)
    tie = (_e4m3(a) + _e4m3(b)) / 2
    ulp = torch.nextafter(r.abs(), torch.tensor(math.inf)) - r.abs()
    near_tie = (r - tie).abs() <= 2 * ulp
    bad = ~(neighbours & near_tie)
    assert not bad.any(), (f"{int(bad.sum())} of {codes.numel()} codes differ away from a tie, "
                           f"e.g. {int(a[bad][0]):#x} vs {int(b[bad][0]):#x} at x/scale "
                           f"{r[bad][0].item()!r}")


def _check_pool(pool, want, written, rows):
    """pool = (k_cache, v_cache, k_scale, v_scale) after a writer, want the reference's; the
    written slots hold `rows` (k, v as stored: [n, Hk, D]) quantized, the others are untouched."""
    pool = [t.cpu() for t in pool]
    kept = torch.ones(pool[0].shape[0], dtype=torch.bool)
    kept[written] = False
    for got, exp in zip(pool, want):
        assert torch.equal(got[kept], exp[kept]), "a slot nobody wrote changed"
    for half, x in enumerate(rows):
        codes, scales = pool[half][written], pool[2 + half][written]
        want_codes, want_scales = want[half][written], want[2 + half][written]
        ratio = x.float() / want_scales[..., None]
        _check_fp8_rows(codes, scales, want_codes, want_scales, ratio)


def test_reference_quantization_rounds_to_nearest_even():
    """The reference itself (no GPU): the tie row's codes, an all-zero row's scale 1."""
    codes, scale = reference.quantize_fp8_rows(torch.tensor([TIE_ROW, [0.0] * 8]))
    assert codes[0].tolist() == TIE_CODES and scale[0].item() == 1.0
    assert not codes[1].any() and scale[1].item() == 1.0
    back = reference.dequantize_fp8_rows(codes, scale)
    assert back[0, 0].item() == 448.0 and back[0, 2].item() == 1.25


# ---------------------------------------------------------------- store_kv_fp8

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim,fused", [(2, 64, False), (3, 128, True), (1, 36, False),
                                                  (8, 256, False)])
def test_store_kv_fp8(dtype, heads, head_dim, fused):
    tokens, slots, width = 11, 64, heads * head_dim
    gen = torch.Generator().manual_seed(heads * head_dim)
    # rows of magnitudes ~1e-3 to ~1e3: scales over a wide range, codes down to subnormals
    kv = torch.randn(tokens, 3 * width, generator=gen) * torch.exp(
        2.5 * torch.randn(tokens, 1, generator=gen))
    kv = kv.to(_dev(), dtype)
    k = kv[:, :width].view(tokens, heads, head_dim)
    v = kv[:, width: 2 * width].view(tokens, heads, head_dim)  # strided rows when fused
    if not fused:
        k, v = k.contiguous(), v.contiguous()
    k[0, 0] = 0
    k[0, 0, :len(TIE_ROW)] = torch.tensor(TIE_ROW, dtype=dtype, device=_dev())
    k[1, 0] = 0  # an all-zero row
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens].to(_dev())
    slot_mapping[[2, 7]] = -1  # padding tokens are skipped
    k_cache, k_scale = _random_pool(slots, heads, head_dim, gen)
    v_cache, v_scale = _random_pool(slots, heads, head_dim, gen)
    want = [t.clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    pool = [t.to(_dev()) for t in (k_cache, v_cache, k_scale, v_scale)]
    ops.store_kv_fp8(k, v, *pool, slot_mapping)

    keep = (slot_mapping >= 0).cpu()
    written = slot_mapping.cpu()[keep]
    kc, vc = k.cpu(), v.cpu()
    reference.store_kv_fp8(kc, vc, *want, slot_mapping.cpu())
    _check_pool(pool, want, written, (kc[keep], vc[keep]))
    tie_slot = int(slot_mapping[0])
    assert pool[0][tie_slot, 0, :len(TIE_ROW)].tolist() == TIE_CODES
    assert pool[2][tie_slot, 0].item() == 1.0 and pool[2][int(slot_mapping[1]), 0].item() == 1.0
    assert not pool[0][int(slot_mapping[1]), 0].any()


# ---------------------------------------------------------------- paged_attention_fp8

def _fp8_batch(seqs, hq, hk, d, dtype, block_size, seed):
    """Random q and FP8 pool for (context, new tokens) pairs, with scattered block tables; each
    pool row has its own magnitude, so its own scale."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    total = sum(need) + 3
    order = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need) + 2, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    pools = []
    for _ in range(2):
        rows = torch.randn(total * block_size, hk, d, generator=gen) * torch.exp(
            0.5 * torch.randn(total * block_size, hk, 1, generator=gen))
        codes, scales = reference.quantize_fp8_rows(rows)
        pools.append((codes.to(_dev()), scales.to(_dev())))
    n_tokens = sum(n for _, n in seqs)
    q = torch.randn(n_tokens, hq, d, generator=gen).to(_dev(), dtype)
    seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=_dev())
    qsl = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, pools, tables.to(_dev()), seq_lens, qsl.to(_dev())


def _reference_attention(q, pools, tables, seq_lens, qsl, block_size, window):
    """reference.paged_attention_fp8 on CPU copies (it indexes with CPU tensors)."""
    (kc, ks), (vc, vs) = pools
    ref = torch.zeros(q.shape, dtype=q.dtype)
    cpu = [t.cpu() for t in (q, kc, vc, ks, vs, tables, seq_lens, qsl)]
    reference.paged_attention_fp8(ref, *cpu, block_size, q.shape[-1] ** -0.5, window)
    return ref


def _close_attention(out, ref, pools):
    """|out| <= max |v| (a convex mix of V rows). The 16-bit tensor-core path rounds K, V (as
    converted from the pool) and the probabilities to the dtype before its products: a few ulps
    of it times max |v|."""
    (_, _), (vc, vs) = pools
    magnitude = reference.dequantize_fp8_rows(vc, vs).abs().max().item()
    assert_close(out.cpu(), ref, out.dtype, magnitude=magnitude, ulps=4)


def _check(seqs, hq, hk, d, dtype, window=0, workspace=True, block_size=16, seed=0,
           unaligned=False):
    q, pools, tables, seq_lens, qsl = _fp8_batch(seqs, hq, hk, d, dtype, block_size, seed)
    if unaligned:  # rows off the 16-byte grid take the CUDA-core kernel (as HIP does always)
        q = torch.cat((torch.zeros_like(q[..., :1]), q), dim=-1)[..., 1:]
    (kc, ks), (vc, vs) = pools
    out = torch.full_like(q, float("nan"))
    ws = torch.empty(WORKSPACE_FLOATS, device=_dev()) if workspace else None
    ops.paged_attention_fp8(out, q, kc, vc, ks, vs, tables, seq_lens, qsl, block_size,
                            d ** -0.5, window, workspace=ws)
    _close_attention(out, _reference_attention(q, pools, tables, seq_lens, qsl, block_size,
                                               window), pools)


DECODE = {"ctx1": [(1, 1)], "ctx100": [(100, 1)], "ctx5000": [(5000, 1)],
          "batch4": [(1, 1), (100, 1), (5000, 1), (300, 1)]}
DTYPES = [torch.bfloat16, torch.float16]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("seqs", DECODE.values(), ids=DECODE.keys())
@pytest.mark.parametrize("workspace", [True, False])
def test_paged_attention_fp8_decode(dtype, d, seqs, workspace):
    _check(seqs, 8, 2, d, dtype, workspace=workspace)  # GQA group 4


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_fp8_sliding_window(dtype):
    _check(DECODE["batch4"], 8, 2, 128, dtype, window=100)
    _check([(500, 37), (64, 1), (700, 300)], 8, 2, 128, dtype, window=48, seed=1)


PREFILL = [(537, 37), (64, 1), (800, 300)]  # chunks of 37 and 300 over cached prefixes


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("unaligned", [False, True])
def test_paged_attention_fp8_prefill(dtype, d, unaligned):
    _check(PREFILL, 8, 2, d, dtype, unaligned=unaligned)
    _check([(37, 37), (300, 300)], 16, 4, d, dtype, block_size=7, seed=2, unaligned=unaligned)


@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_paged_attention_fp8_workspace_or_not(d):
    """A workspace only splits long decode ranges: with or without one, and through the bound
    function with 12 arguments or 13, the outputs agree (within the dtype's rounding; the split
    merge sums in another order)."""
    dtype, bs = torch.bfloat16, 16
    q, pools, tables, seq_lens, qsl = _fp8_batch(DECODE["batch4"], 8, 2, d, dtype, bs, 3)
    (kc, ks), (vc, vs) = pools
    args = (kc, vc, ks, vs, tables, seq_lens, qsl, bs, d ** -0.5, 0)
    ws = torch.empty(WORKSPACE_FLOATS, device=_dev())
    outs = [torch.full_like(q, float("nan")) for _ in range(4)]
    ops.paged_attention_fp8(outs[0], q, *args)
    ops.paged_attention_fp8(outs[1], q, *args, workspace=ws)
    fn = ops.bind("paged_attention_fp8", q.device)
    fn(outs[2], q, *args)
    fn(outs[3], q, *args, ws)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    ref = _reference_attention(q, pools, tables, seq_lens, qsl, bs, 0)
    for out in outs:
        _close_attention(out, ref, pools)
    _close_attention(outs[1], outs[0].cpu(), pools)


# ---------------------------------------------------------------- rope_store_kv_fp8

@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,rot", [(9, 3, 64, 64), (32, 8, 128, 128), (16, 2, 128, 64),
                                         (8, 2, 256, 128)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv_fp8(dtype, hq, hk, d, rot, neox, qk_norm):
    """The same q as rope_store_kv, and its k (normed, rotated, rounded to the dtype) and v
    quantized into the FP8 pool as store_kv_fp8's rule does."""
    g = torch.Generator(device="cpu").manual_seed(hq * d + rot + neox)
    t, slots_n, max_pos = 6, 64, 100
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(_dev(), dtype)
    ang = torch.arange(max_pos)[:, None] * (0.5 ** torch.arange(rot // 2))[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=1).float().to(_dev())
    positions = torch.tensor([0, 5, 99, 37, 63, 2], device=_dev())
    slots = torch.tensor([3, 17, -1, 40, 63, 0], device=_dev())  # -1: padding, skipped
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(_dev(), dtype) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(_dev(), dtype) if qk_norm else None

    def parts(x):
        return x[:, :hq * d], x[:, hq * d:(hq + hk) * d], x[:, (hq + hk) * d:]

    plain_qkv = qkv.clone()
    plain = [torch.zeros(slots_n, hk, d, device=_dev(), dtype=dtype) for _ in range(2)]
    ops.rope_store_kv(positions, *parts(plain_qkv), cos_sin, *plain, slots, qn, kn, 1e-6, d,
                      neox)

    k_cache, k_scale = _random_pool(slots_n, hk, d, g)
    v_cache, v_scale = _random_pool(slots_n, hk, d, g)
    want = [x.clone() for x in (k_cache, v_cache, k_scale, v_scale)]
    pool = [x.to(_dev()) for x in (k_cache, v_cache, k_scale, v_scale)]
    before = qkv.clone()
    ops.rope_store_kv_fp8(positions, *parts(qkv), cos_sin, *pool, slots, qn, kn, 1e-6, d, neox)
    assert torch.equal(qkv[:, hq * d:], before[:, hq * d:])  # k and v are read, not written
    assert torch.equal(qkv, plain_qkv)  # q rotated exactly as rope_store_kv rotates it

    written = slots.cpu()[slots.cpu() >= 0]
    rows = [c.cpu()[written] for c in plain]  # k and v as rope_store_kv stored them
    reference.store_kv_fp8(*rows, *want, written)
    _check_pool(pool, want, written, rows)


@gpu
def test_fp8_bad_arguments_raise():
    dev = _dev()
    k = torch.randn(3, 2, 64, device=dev, dtype=torch.bfloat16)
    codes = torch.zeros(16, 2, 64, dtype=torch.uint8, device=dev)
    scales = torch.ones(16, 2, device=dev)
    slots = torch.arange(3, device=dev)
    with pytest.raises(Exception, match="k_cache must be uint8"):
        ops.store_kv_fp8(k, k, codes.to(torch.bfloat16), codes, scales, scales, slots)
    with pytest.raises(Exception, match="v_scale must be"):
        ops.store_kv_fp8(k, k, codes, codes, scales, scales[:8], slots)
    q = torch.randn(1, 4, 64, device=dev, dtype=torch.bfloat16)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=dev)
    one = torch.ones(1, dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    with pytest.raises(Exception, match="k_scale must be"):
        ops.paged_attention_fp8(torch.empty_like(q), q, codes, codes, scales.T, scales, tables,
                                one, qsl, 16, 0.125)
    with pytest.raises(Exception, match="bfloat16 or float16"):
        ops.paged_attention_fp8(torch.empty_like(q).float(), q.float(), codes, codes, scales,
                                scales, tables, one, qsl, 16, 0.125)
