"""CUDA kernels against the plain-torch references, plus a build check that needs no GPU."""

from __future__ import annotations

import inspect
import math
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from freetoken.kernel import ops, reference
from freetoken.kernel.loader import get_function
from tests.kernel.gated_norm_check import check_gated_norm
from tests.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The GPU kernels use fast-math intrinsics in float32 (__expf: 2 + 1.16 |x| ulps; rsqrtf,
# exp2f: 2 ulps), hence more ulps than plain rounding before the output's own rounding.
FAST_MATH_ULPS = 32
WORKSPACE_FLOATS = 1 << 20


def gpu(fn):
    """Mark a test as needing a CUDA GPU; it skips cleanly without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _close(actual, expected, terms: int = 1):
    """float32 math over `terms` accumulated values, then one rounding to the output dtype."""
    assert_close(actual, expected, actual.dtype, compute=torch.float32, terms=terms,
                 ulps=FAST_MATH_ULPS)


def _close_attention(out, ref, v_cache, context: int):
    """|out| <= max |v| (a convex mix of V rows). The 16-bit tensor-core path rounds the
    probabilities to the input dtype before P @ V: at most one ulp of it times max |v|."""
    magnitude = v_cache.float().abs().max().item()
    if out.dtype == torch.float32:
        assert_close(out, ref, torch.float32, magnitude=magnitude,
                     terms=context + out.shape[-1], ulps=FAST_MATH_ULPS)
    else:
        assert_close(out, ref, out.dtype, magnitude=magnitude, ulps=2)


def _empty(*shape, dtype):
    return torch.empty(*shape, device=_dev(), dtype=dtype)


# ---------------------------------------------------------------- elementwise kernels

@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width,pad", [(1, 64, 0), (7, 576, 0), (33, 4096, 0), (3, 8192, 0),
                                            (5, 100, 0), (4, 130, 3), (6, 256, 64)])
def test_rms_norm(dtype, rows, width, pad):
    torch.manual_seed(rows * width)
    x = torch.randn(rows, width + pad, device=_dev(), dtype=dtype)[:, :width]  # strided if pad
    w = torch.randn(width, device=_dev(), dtype=dtype)
    out, ref = _empty(rows, width, dtype=dtype), _empty(rows, width, dtype=dtype)
    ops.rms_norm(out, x, w, 1e-5)
    reference.rms_norm(ref, x, w, 1e-5)
    _close(out, ref, terms=width)

    r = torch.randn(rows, width, device=_dev(), dtype=dtype)
    x2, r2 = x.clone(), r.clone()
    ops.fused_add_rms_norm(x, r, w, 1e-6)
    reference.fused_add_rms_norm(x2, r2, w, 1e-6)
    _close(r, r2)
    _close(x, x2, terms=width)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64), (80, 32)])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_embedding(dtype, head_dim, rot_dim, is_neox):
    torch.manual_seed(head_dim + rot_dim)
    tokens, hq, hk, max_pos = 9, 4, 2, 300
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, device=_dev(), dtype=dtype)
    q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim: (hq + hk) * head_dim]  # strided views
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=_dev()).float() / rot_dim))
    angles = torch.arange(max_pos, device=_dev()).float()[:, None] * inv_freq[None]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), device=_dev())
    q_ref, k_ref = q.clone(), k.clone()
    ops.rotary_embedding(positions, q, k, cache, head_dim, is_neox)
    reference.rotary_embedding(positions, q_ref, k_ref, cache, head_dim, is_neox)
    _close(q, q_ref, terms=2)
    _close(k, k_ref, terms=2)


@gpu
@pytest.mark.parametrize("op", ["silu_and_mul", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 64), (13, 1000), (5, 37), (300, 2816)])
def test_gated_activations(op, dtype, rows, d):
    x = torch.randn(rows, 2 * d, device=_dev(), dtype=dtype) * 3
    out, ref = _empty(rows, d, dtype=dtype), _empty(rows, d, dtype=dtype)
    getattr(ops, op)(out, x)
    getattr(reference, op)(ref, x)
    _close(out, ref)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim,fused", [(2, 64, False), (3, 128, True), (1, 36, False)])
def test_store_kv(dtype, heads, head_dim, fused):
    tokens, slots = 11, 64
    kv = torch.randn(tokens, (3 if fused else 2) * heads * head_dim, device=_dev(), dtype=dtype)
    k = kv[:, : heads * head_dim].view(tokens, heads, head_dim)
    v = kv[:, heads * head_dim: 2 * heads * head_dim].view(tokens, heads, head_dim)
    slot_mapping = torch.randperm(slots, device=_dev())[:tokens]
    slot_mapping[[2, 7]] = -1  # padding tokens are skipped
    caches = [torch.randn(slots, heads, head_dim, device=_dev(), dtype=dtype) for _ in range(2)]
    refs = [c.clone() for c in caches]
    ops.store_kv(k, v, caches[0], caches[1], slot_mapping)
    reference.store_kv(k, v, refs[0], refs[1], slot_mapping)
    assert torch.equal(caches[0], refs[0]) and torch.equal(caches[1], refs[1])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100, 576])
def test_embedding(dtype, dim):
    table = torch.randn(1000, dim, device=_dev(), dtype=dtype)
    ids = torch.randint(0, 1000, (17,), device=_dev())
    out, ref = _empty(17, dim, dtype=dtype), _empty(17, dim, dtype=dtype)
    ops.embedding(out, ids, table)
    reference.embedding(ref, ids, table)
    assert torch.equal(out, ref)
    ids[3] = 5000  # raising would need a device sync: the CUDA kernel zeroes the row instead
    ops.embedding(out, ids, table)
    assert not out[3].any() and torch.equal(out[4], ref[4])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,groups,width", [(1, 32, 128), (3, 2, 128), (5, 3, 20), (4, 1, 64)])
def test_rms_norm_gated(dtype, t, groups, width):
    check_gated_norm(_dev(), dtype, t, groups, width, ulps=FAST_MATH_ULPS)


@gpu
def test_bad_arguments_raise():
    x = torch.randn(4, 64, device=_dev())
    with pytest.raises(Exception, match="weight"):
        ops.rms_norm(torch.empty_like(x), x, torch.randn(32, device=_dev()), 1e-5)
    with pytest.raises(Exception, match="divides"):
        ops.rms_norm_gated(x, x, x.clone(), torch.randn(40, device=_dev()), 1e-5)
    with pytest.raises(Exception, match="GPU tensor"):
        ops.silu_and_mul(torch.empty(4, 32), x)


# ---------------------------------------------------------------- paged attention

def _attention(out, q, k_cache, v_cache, tables, seq_lens, qsl, block_size, scale, window,
               workspace):
    """ops.paged_attention once it takes the workspace; the exported function until then."""
    if "workspace" in inspect.signature(ops.paged_attention).parameters:
        ops.paged_attention(out, q, k_cache, v_cache, tables, seq_lens, qsl, block_size, scale,
                            window, workspace=workspace)
    else:
        get_function("attention", "paged_attention", q.device)(
            out, q, k_cache, v_cache, tables, seq_lens, qsl, block_size, scale, window, workspace)


def _paged_batch(seqs, hq, hk, d, dtype, block_size, seed):
    """Random q and pool for (context, new tokens) pairs, with scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(ctx / block_size) for ctx, _ in seqs]
    total = sum(need) + 3
    order = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(len(seqs), max(need) + 2, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    caches = [torch.randn(total * block_size, hk, d, generator=gen).to(_dev(), dtype)
              for _ in range(2)]
    n_tokens = sum(n for _, n in seqs)
    q = torch.randn(n_tokens, hq, d, generator=gen).to(_dev(), dtype)
    seq_lens = torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32, device=_dev())
    qsl = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return q, caches, tables.to(_dev()), seq_lens, qsl.to(_dev())


def _reference_attention(q, kc, vc, tables, seq_lens, qsl, block_size, scale, window):
    """reference.paged_attention on CPU copies (it indexes with CPU tensors)."""
    ref = torch.zeros(q.shape, dtype=q.dtype)
    cpu = [t.cpu() for t in (q, kc, vc, tables, seq_lens, qsl)]
    reference.paged_attention(ref, *cpu[:3], *cpu[3:], block_size, scale, window)
    return ref


def _check_attention(seqs, hq, hk, d, dtype, window, block_size=16, workspace=True, seed=0,
                     unaligned=False):
    q, (kc, vc), tables, seq_lens, qsl = _paged_batch(seqs, hq, hk, d, dtype, block_size, seed)
    if unaligned:  # rows off the 16-byte grid take the CUDA-core kernel
        q = torch.cat((torch.zeros_like(q[..., :1]), q), dim=-1)[..., 1:]
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    if workspace:
        ws = torch.empty(WORKSPACE_FLOATS, device=_dev())
        _attention(out, q, kc, vc, tables, seq_lens, qsl, block_size, scale, window, ws)
    else:  # the plain ops call (no workspace argument): no KV split
        ops.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, block_size, scale, window)
    ref = _reference_attention(q, kc, vc, tables, seq_lens, qsl, block_size, scale, window)
    _close_attention(out.cpu(), ref, vc, int(seq_lens.max()))


MIXED = [(37, 37), (100, 1), (300, 45), (1, 1), (65, 1), (129, 64), (20, 3)]
DECODE = [(1, 1), (17, 1), (300, 1), (1000, 1), (2100, 1)]
HEADS = [(4, 4), (8, 2), (12, 4), (20, 1)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("window", [0, 24])
def test_paged_attention_mixed_batch(dtype, d, hq, hk, window):
    _check_attention(MIXED, hq, hk, d, dtype, window)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", HEADS)
@pytest.mark.parametrize("workspace", [True, False])
def test_paged_attention_decode(dtype, d, hq, hk, workspace):
    _check_attention(DECODE, hq, hk, d, dtype, 0, workspace=workspace)
    _check_attention(DECODE[:3], hq, hk, d, dtype, 100, workspace=workspace, seed=1)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_odd_layouts(dtype):
    # T == B without being pure decode, a block size that is not a power of two, one token.
    _check_attention([(5, 2), (9, 0), (40, 1)], 8, 2, 128, dtype, 0)
    _check_attention(MIXED, 8, 2, 64, dtype, 0, block_size=7)
    _check_attention([(1, 1)], 4, 1, 128, dtype, 0)
    _check_attention(MIXED, 8, 2, 128, dtype, 16, unaligned=True)
    _check_attention(DECODE, 12, 4, 64, dtype, 0, unaligned=True)


@gpu
def test_paged_attention_replays_in_a_cuda_graph():
    dtype, hq, hk, d, bs = torch.bfloat16, 8, 2, 128, 16
    q, (kc, vc), tables, seq_lens, qsl = _paged_batch([(900, 1)] * 4, hq, hk, d, dtype, bs, 3)
    out, ws = torch.zeros_like(q), torch.empty(WORKSPACE_FLOATS, device=_dev())
    args = (kc, vc, tables, seq_lens, qsl, bs, d ** -0.5, 0, ws)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _attention(out, q, *args)  # loads the module outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _attention(out, q, *args)
    seq_lens.copy_(torch.tensor([5, 900, 333, 64], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    _close_attention(out.cpu(), _reference_attention(q, kc, vc, tables, seq_lens, qsl, bs,
                                                     d ** -0.5, 0), vc, 900)


@gpu
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 32, 8)])
def test_paged_attention_decode_bits_do_not_depend_on_table_width(d, hq, hk):
    """CUDA graphs capture decode with the widest block tables, eager steps pass narrow ones:
    a short context must split into the same key ranges either way (at least 64 keys per
    split), or the two round differently. The zero-padded wide table must give the same bits;
    both stay close to the reference."""
    dtype, bs = torch.bfloat16, 16
    q, (kc, vc), tables, seq_lens, qsl = _paged_batch([(300, 1), (45, 1)], hq, hk, d, dtype,
                                                      bs, 5)
    wide = torch.zeros(tables.shape[0], 256, dtype=tables.dtype, device=tables.device)
    wide[:, :tables.shape[1]] = tables
    outs = []
    for table in (tables, wide):
        out, ws = torch.full_like(q, float("nan")), torch.empty(WORKSPACE_FLOATS, device=_dev())
        _attention(out, q, kc, vc, table.contiguous(), seq_lens, qsl, bs, d ** -0.5, 0, ws)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = _reference_attention(q, kc, vc, tables, seq_lens, qsl, bs, d ** -0.5, 0)
    _close_attention(outs[1].cpu(), ref, vc, 300)


# ---------------------------------------------------------------- sampling

def _sample(logits, temperature, top_k=0, top_p=1.0, seed=0, offset=0):
    rows = logits.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    temp = torch.full((rows,), temperature, device=logits.device) if isinstance(
        temperature, float) else temperature
    args = (out, logits, temp, torch.full((rows,), top_k, dtype=torch.int32, device=logits.device),
            torch.full((rows,), top_p, device=logits.device), seed, offset)
    fn = getattr(ops, "sample_tokens", None) or get_function("sampling", "sample_tokens",
                                                             logits.device)
    fn(*args)
    return out


def _allowed(logits, temperature, top_k, top_p):
    """Tokens top-k then top-p may keep (ties at a threshold count as kept)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        keep &= logits >= logits.topk(top_k, -1).values[..., -1:]
    if top_p < 1.0:
        p = torch.where(keep, probs, 0.0)
        p = p / p.sum(-1, keepdim=True)
        sorted_p = p.sort(-1, descending=True).values
        n = (sorted_p.cumsum(-1) < top_p * (1 - 1e-9)).sum(-1, keepdim=True)
        keep &= p >= sorted_p.gather(-1, n.clamp(max=p.shape[-1] - 1)) * (1 - 1e-6)
    return keep, probs


@gpu
def test_sampling_greedy_and_top1_are_argmax():
    logits = torch.randn(64, 49152, device=_dev()) * 3
    argmax = logits.argmax(-1)
    assert torch.equal(_sample(logits, 0.0), argmax)
    assert torch.equal(_sample(logits, 1.0, top_k=1, seed=7), argmax)
    mixed = torch.where(torch.arange(64, device=_dev()) % 2 == 0, 0.0, 1.0)
    got = _sample(logits, mixed.float(), top_k=1)
    assert torch.equal(got, argmax)


@gpu
def test_sampling_is_reproducible_per_seed_and_offset():
    logits = torch.randn(32, 1000, device=_dev())
    a = _sample(logits, 1.0, seed=123, offset=5)
    assert torch.equal(a, _sample(logits, 1.0, seed=123, offset=5))
    assert not torch.equal(a, _sample(logits, 1.0, seed=123, offset=6))
    assert not torch.equal(a, _sample(logits, 1.0, seed=124, offset=5))


@gpu
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.8)])
def test_sampling_distribution(top_k, top_p):
    rows, temperature = 40000, 0.8
    row = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0], device=_dev())
    counts = torch.zeros(len(row), device=_dev())
    for offset in range(2):
        ids = _sample(row.expand(rows, -1).contiguous(), temperature, top_k, top_p, 11, offset)
        counts += torch.bincount(ids, minlength=len(row)).float()
    keep, probs = _allowed(row[None], temperature, top_k, top_p)
    keep, probs = keep[0], probs[0].float()
    assert counts[~keep].sum() == 0, "sampled a token outside top-k / top-p"
    expected = torch.where(keep, probs, 0.0)
    expected = expected / expected.sum() * counts.sum()
    chi2 = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    assert chi2 < 60.0, (chi2, counts.tolist(), expected.tolist())  # df <= 7: p < 1e-9


@gpu
def test_sampling_large_vocab_stays_in_nucleus():
    torch.manual_seed(0)
    logits = torch.randn(8, 151936, device=_dev()) * 4
    for top_k, top_p in [(50, 0.9), (0, 0.9), (1000, 0.5), (0, 0.0)]:
        keep, _ = _allowed(logits, 0.7, top_k, top_p)
        for offset in range(4):
            ids = _sample(logits, 0.7, top_k, top_p, seed=3, offset=offset)
            assert keep.gather(1, ids[:, None]).all(), (top_k, top_p, ids.tolist())


# ---------------------------------------------------------------- build (no GPU needed)

@pytest.mark.slow
def test_cuda_kernels_compile_for_sm90a(tmp_path):
    """Every registry CUDA kernel builds for sm_90a with the exact cache-wheel command: the
    cache wheel under test's objects where it holds them all (tests/kernel/prebuilt.py: each an
    ELF shared object with embedded device code), else compiled here."""
    import tvm_ffi.libinfo as libinfo

    from freetoken.csrc import build
    from freetoken.toolchain import checks
    from tests.kernel.prebuilt import prebuilt_objects

    found = checks.find_nvcc()
    if found is None:
        pytest.skip("no CUDA toolkit (nvcc with its static runtime)")
    tc = build.Toolchain(
        tvm_include=(libinfo.find_include_path(), libinfo.find_dlpack_include_path()),
        tvm_libdir=str(Path(libinfo.find_libtvm_ffi()).parent),
        nvcc=found[0].path, cuda_major=found[0].major)
    jobs = build.jobs_for(("sm_90a",), tc.cuda_major)
    assert {j.kernel for j in jobs} >= {"norm", "rotary", "activation", "kv_cache", "embedding",
                                         "attention", "sampling", "moe"}
    prebuilt = prebuilt_objects(jobs, tmp_path)
    if prebuilt is not None:
        readelf = shutil.which("readelf")
        for job, so in prebuilt:
            assert so.read_bytes()[:4] == b"\x7fELF", job.output
            if readelf is not None:    # the device code nvcc embeds
                sections = subprocess.run([readelf, "-S", "-W", str(so)], capture_output=True,
                                          text=True, check=True).stdout
                assert ".nv_fatbin" in sections, job.output
        return

    def compile_one(job):
        out = tmp_path / f"{job.kernel}.so"
        done = subprocess.run(build.compile_command(job, out, tc), capture_output=True, text=True,
                              env={**os.environ, "CUDA_HOME": str(found[1])})
        return job.kernel, done.returncode, done.stderr[-3000:], out

    with ThreadPoolExecutor(max_workers=2) as pool:
        for kernel, rc, err, out in pool.map(compile_one, jobs):
            assert rc == 0, f"{kernel}: {err}"
            assert out.stat().st_size > 0
