"""The fused decode kernels (decode_gemv*, rope_store_kv) against the unfused chain they replace,
run through the plain-torch references; plus the load-time rule, which needs no GPU."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.arrays import parse_device
from freetoken.kernel import ops, reference
from freetoken.models.forward import fused_decode
from tests.tolerances import EPS, assert_close

DTYPES = [torch.bfloat16, torch.float16]
FAST_MATH_ULPS = 32  # __expf / rsqrtf in f32, as in test_cuda_kernels.py


def gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _sms() -> int:
    return torch.cuda.get_device_properties(_dev()).multi_processor_count


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _order_error(xn, w):
    """What the f32 summation order of a dot product over K can move it by, per output:
    FAST_MATH_ULPS f32 ulps of sum |x_i w_i|, growing like sqrt(K) (float64 numpy [T, N])."""
    k = xn.shape[1]
    mag = (xn.float().abs() @ w.float().abs().T).double().cpu().numpy()
    return FAST_MATH_ULPS * EPS["float32"] * mag * math.sqrt(k)


def _assert_dot_close(out, ref, xn, w, dtype):
    """A dot product over K in f32, rounded once to dtype. When the kernel norms x itself, an
    element of xn may round to the neighbouring dtype value (its f32 inverse RMS is summed in
    another order): allow a few such flips, each at most one ulp of that element's product."""
    flips = 4 * EPS[_dtype_name(dtype)] * (xn.float().abs().max() * w.float().abs().max()).item()
    e = ref.double().cpu().numpy()
    limit = _order_error(xn, w) + flips + 2 * EPS[_dtype_name(dtype)] * np.abs(e)
    err = np.abs(out.double().cpu().numpy() - e)
    assert (err <= limit).all(), f"max excess {(err - limit).max():.3g} at {np.argmax(err - limit)}"


VARIANTS = range(len(fused_decode.GEMV_VARIANTS))


def _groups(n, k, variant=0):
    """One warp per row, a whole block per row (the split-K reduction), and the rule's pick."""
    threads = fused_decode.GEMV_VARIANTS[variant].threads
    return sorted({32, threads, min(threads, fused_decode.gemv_group(n, k, _sms()))})


def _normed(x, norm, eps):
    if norm is None:
        return x
    xn = torch.empty_like(x)
    reference.rms_norm(xn, x, norm, eps)
    return xn


@functools.lru_cache(maxsize=16)
def _weight(n, k):
    """float32 [N, K], made once per shape: every dtype, token count and variant reads it
    (a 24576 x 4096 randn takes about a second on the host)."""
    g = torch.Generator(device="cpu").manual_seed(n * k)
    return torch.randn(n, k, generator=g) / math.sqrt(k)


def _inputs(t, n, k, dtype, seed, x_pad=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, k + x_pad, generator=g).to(_dev(), dtype)[:, :k]  # strided when padded
    return x, _weight(n, k).to(_dev(), dtype), g


# ---------------------------------------------------------------- decode_gemv (+ norm, bias)

@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (6144, 4096), (72, 2048)])
@pytest.mark.parametrize("norm,bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_gemv(dtype, t, n, k, norm, bias, variant):
    x, w, g = _inputs(t, n, k, dtype, seed=n * k + t, x_pad=8)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(_dev(), dtype) if norm else None
    b = torch.randn(n, generator=g).to(_dev(), dtype) if bias else None
    xn = _normed(x, nw, 1e-6)
    ref = xn.float() @ w.float().T + (b.float() if bias else 0)
    for group in _groups(n, k, variant):
        out = torch.full((t, n), float("nan"), device=_dev(), dtype=dtype)
        ops.decode_gemv(out, x, w, b, nw, 1e-6, group, variant)
        _assert_dot_close(out, ref.to(dtype), xn, w, dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,n,k", [(1, 576, 576), (8, 4096, 12288), (5, 2048, 768)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_gemv_add(dtype, t, n, k, variant):
    x, w, g = _inputs(t, n, k, dtype, seed=7 * n + k)
    residual = torch.randn(t, n, generator=g).to(_dev(), dtype)
    prod = (x.float() @ w.float().T).to(dtype)  # the unfused chain: mm, then the add
    ref = (residual.float() + prod.float()).to(dtype)
    # the product may round to its neighbour (one ulp of it) or, where it nearly cancels,
    # further (its f32 summation order); the sum then rounds once more (2 ulp of |ref|)
    mag = prod.float().abs().cpu().numpy() + _order_error(x, w) / EPS[_dtype_name(dtype)]
    for group in _groups(n, k, variant):
        out = residual.clone()
        ops.decode_gemv_add(out, x, w, group, variant)
        assert_close(out, ref, dtype, magnitude=mag, ulps=2, msg=f"group {group}")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 4, 8])
@pytest.mark.parametrize("inter,k", [(1536, 576), (12288, 4096), (768, 2048)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_gemv_swiglu(dtype, t, inter, k, norm, variant):
    x, w, g = _inputs(t, 2 * inter, k, dtype, seed=inter + k + t)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(_dev(), dtype) if norm else None
    xn = _normed(x, nw, 1e-5)
    gate_up = (xn.float() @ w.float().T).to(dtype)  # the unfused chain: mm, then silu_and_mul
    ref = torch.empty(t, inter, device=_dev(), dtype=dtype)
    reference.silu_and_mul(ref, gate_up)
    gf, uf = gate_up[:, :inter].float().cpu(), gate_up[:, inter:].float().cpu()
    # g and u may each round to their neighbour, or further where they nearly cancel (f32
    # order, `order` below, in dtype ulps; with the norm in the prologue, plus a few flipped
    # elements of xn as in _assert_dot_close): d(silu(g) u) is that error of g times
    # |silu'(g) u| (|silu'| < 1.1) plus that of u times |silu(g)|
    flips = 4 * (xn.float().abs().max() * w.float().abs().max()).item() if norm else 0.0
    order = torch.from_numpy(_order_error(xn, w) / EPS[_dtype_name(dtype)]).float() + flips
    og, ou = order[:, :inter], order[:, inter:]
    mag = (1.1 * (gf.abs() + og) * uf.abs()
           + torch.nn.functional.silu(gf).abs() * (uf.abs() + ou)).numpy()
    for group in _groups(inter, k, variant):
        out = torch.full((t, inter), float("nan"), device=_dev(), dtype=dtype)
        ops.decode_gemv_swiglu(out, x, w, nw, 1e-5, group, variant)
        assert_close(out, ref, dtype, magnitude=mag, ulps=1, msg=f"group {group}")


@gpu
def test_decode_gemv_rejects_bad_shapes():
    x = torch.zeros(9, 64, device=_dev(), dtype=torch.bfloat16)
    w = torch.zeros(32, 64, device=_dev(), dtype=torch.bfloat16)
    out = torch.zeros(9, 32, device=_dev(), dtype=torch.bfloat16)
    with pytest.raises(Exception, match="at most 8 tokens"):
        ops.decode_gemv(out, x, w, None, None, 1e-6, 32)
    with pytest.raises(Exception, match="group"):
        ops.decode_gemv(out[:2], x[:2], w, None, None, 1e-6, 48)


def _layer_chain(res, wts, nw, act, qkv, variant):
    """qkv GEMV (norm prologue), o add, gate/up SwiGLU (norm prologue), down add: each reads
    what the one before wrote, as in a decode step (a launched-early variant must wait)."""
    w_qkv, w_o, w_gu, w_down = wts
    ops.decode_gemv(qkv, res, w_qkv, None, nw, 1e-6, 32, variant)
    ops.decode_gemv_add(res, qkv[:, :w_o.shape[1]], w_o, 32, variant)
    ops.decode_gemv_swiglu(act, res, w_gu, nw, 1e-6, 32, variant)
    ops.decode_gemv_add(res, act, w_down, 32, variant)


@gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("graph", [False, True])
def test_decode_gemv_chain_reads_what_the_previous_kernel_wrote(variant, graph):
    """The layer chain eager and replayed from a CUDA graph, against the same chain of the
    plain-torch references fed the kernels' own intermediates (a kernel that read its input
    before the previous one finished would be off by O(1))."""
    h, inter, t, dtype = 1024, 2048, 2, torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(variant)
    wts = [(torch.randn(n, k, generator=g) / math.sqrt(k)).to(_dev(), dtype)
           for n, k in ((2 * h, h), (h, h), (2 * inter, h), (h, inter))]
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(_dev(), dtype)
    res0 = torch.randn(t, h, generator=g).to(_dev(), dtype)
    res, act = res0.clone(), torch.empty(t, inter, device=_dev(), dtype=dtype)
    qkv = torch.empty(t, 2 * h, device=_dev(), dtype=dtype)
    if graph:
        _layer_chain(res, wts, nw, act, qkv, variant)  # load the kernels outside the capture
        res.copy_(res0)
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            _layer_chain(res, wts, nw, act, qkv, variant)
        res.copy_(res0)
        cuda_graph.replay()
    else:
        _layer_chain(res, wts, nw, act, qkv, variant)
    # the references, step by step from the kernels' outputs (only the last add is redone)
    want_qkv = torch.empty_like(qkv)
    reference.decode_gemv(want_qkv, res0, wts[0], None, nw, 1e-6, 32)
    _assert_dot_close(qkv, want_qkv.float(), _normed(res0, nw, 1e-6), wts[0], dtype)
    # the residual between the two adds is not observable: rebuilt by the reference, it may
    # differ from the kernel's by an ulp here and there, and so may what follows from it; each
    # of the chain's four roundings moves a result by about an ulp of the largest value, so 8
    # ulps of it bound the rest, while a stale input moves it by O(its magnitude)
    mid = res0.clone()
    reference.decode_gemv_add(mid, qkv[:, :h], wts[1], 32)
    want_act = torch.empty_like(act)
    reference.decode_gemv_swiglu(want_act, mid, wts[2], nw, 1e-6, 32)
    want = mid.clone()
    reference.decode_gemv_add(want, act, wts[3], 32)
    for got, ref in ((act, want_act), (res, want)):
        limit = 8 * EPS["bfloat16"] * ref.float().abs().max().item()
        assert (got.float() - ref.float()).abs().max().item() <= limit


@gpu
def test_decode_gemv_variant_table_matches_the_kernel():
    """GEMV_VARIANTS mirrors the kernel's table: as many rows, the same block sizes."""
    x = torch.zeros(2, 64, device=_dev(), dtype=torch.bfloat16)
    w = torch.zeros(32, 64, device=_dev(), dtype=torch.bfloat16)
    out = torch.zeros(2, 32, device=_dev(), dtype=torch.bfloat16)
    count = len(fused_decode.GEMV_VARIANTS)
    with pytest.raises(Exception, match=rf"variant must be in \[0, {count}\)"):
        ops.decode_gemv(out, x, w, None, None, 1e-6, 32, count)
    for variant, knobs in enumerate(fused_decode.GEMV_VARIANTS):
        ops.decode_gemv(out, x, w, None, None, 1e-6, min(knobs.threads, 256), variant)
        if knobs.threads < 256:
            with pytest.raises(Exception, match=f"blocks of {knobs.threads} threads"):
                ops.decode_gemv(out, x, w, None, None, 1e-6, 2 * knobs.threads, variant)


# ---------------------------------------------------------------- rope_store_kv

def _chain(positions, qkv, cos_sin, k_cache, v_cache, slots, qn, kn, hq, hk, d, neox):
    """The unfused chain on a copy: per-head rms_norm, rotary_embedding, store_kv."""
    qkv = qkv.clone()
    t = qkv.shape[0]
    q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], qkv[:, (hq + hk) * d:]
    q, k = q.contiguous(), k.contiguous()
    if qn is not None:
        for part, weight in ((q, qn), (k, kn)):
            heads = part.view(-1, d)
            reference.rms_norm(heads, heads.clone(), weight, 1e-6)
    reference.rotary_embedding(positions, q, k, cos_sin, d, neox)
    reference.store_kv(k.view(t, hk, d), v.reshape(t, hk, d), k_cache, v_cache, slots)
    return q


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d,rot", [(9, 3, 64, 64), (32, 8, 128, 128), (16, 2, 128, 64)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_kv(dtype, hq, hk, d, rot, neox, qk_norm):
    g = torch.Generator(device="cpu").manual_seed(hq * d + rot + neox)
    t, slots_n, max_pos = 6, 64, 100
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(_dev(), dtype)
    ang = torch.arange(max_pos)[:, None] * (0.5 ** torch.arange(rot // 2))[None, :]
    cos_sin = torch.cat((ang.cos(), ang.sin()), dim=1).float().to(_dev())
    positions = torch.tensor([0, 5, 99, 37, 63, 2], device=_dev())
    slots = torch.tensor([3, 17, -1, 40, 63, 0], device=_dev())      # -1: padding, skipped
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(_dev(), dtype) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(_dev(), dtype) if qk_norm else None
    caches = [torch.randn(slots_n, hk, d, generator=g).to(_dev(), dtype) for _ in range(2)]
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    ref_q = _chain(positions, qkv, cos_sin, ref_k, ref_v, slots, qn, kn, hq, hk, d, neox)

    before = qkv.clone()
    q, k, v = qkv[:, :hq * d], qkv[:, hq * d:(hq + hk) * d], qkv[:, (hq + hk) * d:]
    ops.rope_store_kv(positions, q, k, v, cos_sin, caches[0], caches[1], slots, qn, kn, 1e-6,
                      d, neox)
    assert torch.equal(qkv[:, hq * d:], before[:, hq * d:])  # k and v are read, not written
    # one ulp of |x| (a normed element may round to its neighbour: its f32 inverse RMS sums in
    # another order; the rotation may contract into an FMA), times |cos| + |sin| <= sqrt 2
    mag = 2 * max(ref_q.float().abs().max().item(), ref_k.float().abs().max().item())
    assert_close(q, ref_q, dtype, magnitude=mag, ulps=1)
    assert_close(caches[0], ref_k, dtype, magnitude=mag, ulps=1)
    assert torch.equal(caches[1], ref_v)  # v is copied, slot -1 skipped, other slots untouched


# ---------------------------------------------------------------- the load-time rule (CPU)

def test_gemv_group_fills_the_gpu_only_when_rows_are_few():
    assert fused_decode.gemv_group(6144, 4096, 132) == 32       # 768 blocks: one warp a row
    assert fused_decode.gemv_group(576, 1536, 132) == 64        # few rows: split K
    assert fused_decode.gemv_group(576, 8192, 132) == 128       # 288 blocks
    assert fused_decode.gemv_group(960, 576, 132) == 32         # K too short to split
    assert fused_decode.gemv_group(4096, 12288, 132) == 32


def test_fused_decode_is_gpu_16_bit_only(monkeypatch):
    class Cfg:  # the fields of ModelConfig that the rule reads
        qk_norm, hidden_size, q_size, kv_size, intermediate_size = None, 64, 64, 32, 128
        activation, block_out_norms, embed_scale, linear, attn_output_gate = (
            "silu", False, 1.0, None, False)

        @staticmethod
        def is_sparse(i):
            return False

        @staticmethod
        def is_linear(i):
            return False

    w = torch.zeros(128, 64, dtype=torch.bfloat16)
    # as the loader stores them: "qkv" and "gate_up" are lists of row parts, one matrix when
    # the parts concatenate (checkpoint/weights.py's _fuse_rows)
    layers = [{"qkv": [w], "o": w[:64], "gate_up": [w], "down": torch.zeros(64, 128)}]
    cpu, gpu_dev = parse_device("cpu"), parse_device("cuda:0")
    assert not fused_decode.supported(Cfg, layers, "bfloat16", cpu)
    assert not fused_decode.supported(Cfg, layers, "float32", gpu_dev)
    assert fused_decode.supported(Cfg, layers, "bfloat16", gpu_dev)
    split = [dict(layers[0], qkv=[w[:64], w[64:96], w[96:]])]  # parts that did not concatenate
    assert not fused_decode.supported(Cfg, split, "bfloat16", gpu_dev)
    monkeypatch.setenv("FREETOKEN_FUSED_DECODE", "0")
    assert not fused_decode.supported(Cfg, layers, "bfloat16", gpu_dev)
    monkeypatch.delenv("FREETOKEN_FUSED_DECODE")
    for field, value in (("activation", "gelu_tanh"), ("block_out_norms", True),
                         ("embed_scale", 8.0)):
        monkeypatch.setattr(Cfg, field, value)      # gemma3's layers stay unfused
        assert not fused_decode.supported(Cfg, layers, "bfloat16", gpu_dev), field
        monkeypatch.undo()
    # a hybrid: a Gated DeltaNet layer (plain in/out projections) and a gated attention layer
    # (its o_gate plain too); a split in-projection or a width the GEMV cannot store is refused
    lin = SimpleNamespace(projection_size=136, value_dim=32)
    monkeypatch.setattr(Cfg, "linear", lin)
    monkeypatch.setattr(Cfg, "attn_output_gate", True)
    monkeypatch.setattr(Cfg, "is_linear", staticmethod(lambda i: i == 0))
    gdn_in, gdn_out = torch.zeros(136, 64, dtype=torch.bfloat16), torch.zeros(64, 32)
    gdn = {"gdn.in": [gdn_in], "gdn.out": gdn_out.to(torch.bfloat16), "gate_up": [w],
           "down": layers[0]["down"]}
    hybrid = [gdn, dict(layers[0], o_gate=w[:64])]
    assert fused_decode.supported(Cfg, hybrid, "bfloat16", gpu_dev)
    split_in = [dict(gdn, **{"gdn.in": [gdn_in[:64], gdn_in[64:]]}), hybrid[1]]
    assert not fused_decode.supported(Cfg, split_in, "bfloat16", gpu_dev)
    monkeypatch.setattr(lin, "projection_size", 130)
    assert not fused_decode.supported(Cfg, hybrid, "bfloat16", gpu_dev)
    monkeypatch.undo()
    Cfg.qk_norm = "full"
    assert not fused_decode.supported(Cfg, layers, "bfloat16", gpu_dev)


def test_tuned_table_entries_are_valid():
    """What the sweep pasted in names a compiled variant and a group that fits its blocks."""
    for (projection, n, k, tokens), c in fused_decode.TUNED.items():
        assert projection in ("qkv", "add", "swiglu") and n > 0 and k % 8 == 0
        assert 1 <= tokens <= fused_decode.MAX_TOKENS
        assert 0 <= c.variant < len(fused_decode.GEMV_VARIANTS)
        assert c.group == 0 or c.group in fused_decode._GROUPS
        assert c.group <= fused_decode.GEMV_VARIANTS[c.variant].threads
        assert projection != "add" or c.norm_prologue is None


def test_gemv_plan_takes_the_table_over_the_rules(monkeypatch):
    choice = fused_decode.GemvChoice
    # a table of only these entries: the pasted sweep may list this shape's other counts
    monkeypatch.setattr(fused_decode, "TUNED", {("qkv", 6144, 4096, 1): choice(4, 0, False),
                                                ("qkv", 6144, 4096, 3): choice(2, 64, True)})
    plan = fused_decode.gemv_plan("qkv", 6144, 4096, 132)
    assert len(plan) == fused_decode.MAX_TOKENS + 1
    assert plan[1] == choice(4, 32, False)
    assert plan[2] == choice(0, 32, True)   # unlisted: the rules
    assert plan[3] == choice(2, 64, True)
    assert plan[4] == choice(0, 32, False)  # the norm as its own kernel past 2 tokens
    # the rule's group (256 here) is capped at the variant's block of 128 threads
    assert fused_decode.gemv_group(64, 16384, 132) == 256
    monkeypatch.setitem(fused_decode.TUNED, ("add", 64, 16384, 1), choice(4))
    assert fused_decode.gemv_plan("add", 64, 16384, 132)[1].group == 128
