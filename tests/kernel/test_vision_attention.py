"""vision_attention (non-causal attention within cu_seqlens segments) against the torch
reference: CPU kernel here, CUDA kernels on a GPU (tensor cores for bf16/f16, CUDA cores for
float32); head dims 8..128 including 72 (Qwen3.5's tower), segments of uneven lengths (one
shorter than a tile, one spanning several, one ending on a tile boundary, one of 1024x1024's
4096 patches), q/k/v as column slices of one fused qkv buffer as the tower passes them."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernel import ops, reference
from tests.tolerances import assert_close

FAST_MATH_ULPS = 32
SEGMENTS = [[0, 5, 5, 69, 100], [0, 40]]      # an empty segment, tiles cut mid-segment


def gpu(fn):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


def _inputs(cu, heads, dim, dtype, device):
    gen = torch.Generator().manual_seed(dim * 7 + heads)
    tokens = cu[-1]
    qkv = (torch.randn(tokens, 3 * heads * dim, generator=gen) * 2).to(dtype).to(device)
    width = heads * dim
    q, k, v = qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    return q, k, v, cu_t


def _check(out, ref, v, cu, tensor_cores: bool):
    """A convex mix of V rows per segment: error scales with max |v|, accumulated over the
    segment's keys and the head dim in float32, then one rounding to the output dtype. The
    tensor-core kernel also rounds each probability to the input dtype before P.V: half an ulp
    of each weight of the mix, and of the sum it is normalised by, so about one ulp of max |v|
    (4 allowed), while a wrong key, mask or scale is off by O(max |v|)."""
    magnitude = v.float().abs().max().item()
    if tensor_cores:
        assert_close(out, ref, out.dtype, magnitude=magnitude, ulps=4)
        return
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    assert_close(out, ref, out.dtype, compute=torch.float32, magnitude=magnitude,
                 terms=longest + 128, ulps=FAST_MATH_ULPS)


def _run(device, dtype, heads, dim, cu):
    q, k, v, cu_t = _inputs(cu, heads, dim, dtype, device)
    out = torch.full((cu[-1], heads * dim), float("nan"), dtype=dtype, device=device)
    ops.vision_attention(out, q, k, v, cu_t, heads, dim ** -0.5)
    ref = torch.empty_like(out)
    reference.vision_attention(ref, q.cpu().float(), k.cpu().float(), v.cpu().float(),
                               cu_t.cpu(), heads, dim ** -0.5)
    tensor_cores = (out.is_cuda and torch.version.hip is None
                    and dtype in (torch.bfloat16, torch.float16))
    _check(out.cpu(), ref.cpu().to(dtype), v, cu, tensor_cores)


@pytest.mark.parametrize("dim", [8, 72])
@pytest.mark.parametrize("cu", SEGMENTS)
def test_cpu_kernel_matches_reference(dim, cu):
    _run("cpu", torch.float32, 2, dim, cu)


def test_cpu_kernel_rejects_bad_segments():
    q, k, v, _ = _inputs([0, 8], 2, 8, torch.float32, "cpu")
    out = torch.empty_like(q.contiguous())
    with pytest.raises(Exception, match="cu_seqlens"):
        ops.vision_attention(out, q, k, v, torch.tensor([0, 7], dtype=torch.int32), 2, 1.0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [8, 40, 64, 72, 128])
@pytest.mark.parametrize("cu", SEGMENTS + [[0, 1024, 1500], [0, 64, 64, 200, 4096]])
def test_cuda_kernel_matches_reference(dtype, dim, cu):
    _run(torch.device("cuda"), dtype, 3, dim, cu)
