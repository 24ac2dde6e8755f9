"""The streaming decode GEMVs (kernels/cuda/quant_gemv.cu) on the GPU: gguf_gemv against torch
on the weights gguf's numpy dequantizer reads from the same blocks, fp8_gemv against the
bit-by-bit float64 dequantization of the FP8 weight; every rows-per-warp variant, T = 1..8,
an odd N, K at block multiples with a partial last chunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from freetoken.models.quant import scaled
from tests.kernel.gguf_random import NAMES, dequantize, random_blocks
from tests.kernel.test_gguf_gemm import _check
from tests.models.scaled_checkpoint import e4m3_values, expand, quantize_fp8
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N = 203                      # odd: the last warp's rows run past N
VARIANTS = (0, 1, 2, 4)      # rows per warp (0: the kernel's choice)
# K per type: a single chunk (small) and several chunks with a partial last one (large), rows
# always whole 16-byte words (Q4_0, Q5_0, Q8_0 and Q6_K need 8 blocks for that, Q5_1 two).
GGUF_K = {2: (256, 8192), 6: (256, 8192), 7: (64, 6016), 8: (256, 4352), 12: (256, 7680),
          14: (2048, 6144)}


def _gguf(qtype: int, k: int):
    blocks = random_blocks(qtype, N, k, np.random.default_rng(qtype * 31 + k))
    w = torch.from_numpy(dequantize(blocks, qtype)).double()
    return torch.from_numpy(blocks).cuda(), w


@pytest.mark.parametrize("qtype", sorted(GGUF_K), ids=lambda t: NAMES[t])
@pytest.mark.parametrize("size", (0, 1), ids=("one-chunk", "chunks"))
@pytest.mark.parametrize("rows", VARIANTS)
def test_gguf_gemv_matches_torch_on_dequantized_weights(qtype, size, rows):
    k = GGUF_K[qtype][size]
    qweight, w = _gguf(qtype, k)
    for t in range(1, 9):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to("cuda", torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.full((t, N), float("nan"), device="cuda", dtype=dtype)
            ops.gguf_gemv(out, x, qweight, qtype, rows)
            _check(out, x, w, gemm=False)


def test_gguf_gemv_writes_a_column_slice_only():
    qweight, w = _gguf(12, 512)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)).to("cuda", torch.bfloat16)
    out = torch.full((3, N + 9), 7.0, device="cuda", dtype=torch.bfloat16)
    ops.gguf_gemv(out[:, 4:4 + N], x, qweight, 12, 2)
    _check(out[:, 4:4 + N], x, w, gemm=False)
    assert (out[:, :4] == 7.0).all() and (out[:, 4 + N:] == 7.0).all()


def test_gguf_gemv_refuses_what_it_does_not_read():
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 4, device="cuda", dtype=torch.float32)
    q5k = torch.zeros(4, 176, device="cuda", dtype=torch.uint8)
    with pytest.raises(Exception, match="Q4_0 .2., Q5_0 .6., Q5_1 .7., Q8_0 .8., Q4_K .12. and "
                                       "Q6_K .14."):
        ops.gguf_gemv(out, x, q5k, 13, 0)
    q6k = torch.zeros(4, 210, device="cuda", dtype=torch.uint8)   # 210 bytes: not whole words
    with pytest.raises(Exception, match="multiple of 16 bytes"):
        ops.gguf_gemv(out, x, q6k, 14, 0)
    q5_0 = torch.zeros(4, 88, device="cuda", dtype=torch.uint8)   # 4 Q5_0 blocks: 88 bytes
    with pytest.raises(Exception, match="multiple of 16 bytes"):
        ops.gguf_gemv(out, x[:, :128].contiguous(), q5_0, 6, 0)
    q4k = torch.zeros(4, 144, device="cuda", dtype=torch.uint8)
    with pytest.raises(Exception, match="rows .weight rows per warp. must be"):
        ops.gguf_gemv(out, x, q4k, 12, 3)
    with pytest.raises(Exception, match="at most 8 rows"):
        ops.gguf_gemv(torch.empty(9, 4, device="cuda"), x.expand(9, 256).contiguous(), q4k, 12, 0)


# (N, K, block): 128x128 blocks with a cut last block column, per channel, per tensor
FP8_CASES = [(N, 4096 + 16, (128, 128)), (N, 1040, (128, 128)), (N, 2048, (1, 2048)),
             (N, 336, (N, 336))]


def _fp8(n, k, block):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    q, grid = quantize_fp8(w, *block)
    ref = e4m3_values(q.view(torch.uint8).numpy()) * expand(grid.double().numpy(), *block, n, k)
    weight = scaled.to_device(scaled.ScaledWeight(scaled.FP8, q, grid, (n, k), block), "cuda")
    return weight, torch.from_numpy(ref)


@pytest.mark.parametrize("n, k, block", FP8_CASES)
@pytest.mark.parametrize("rows", VARIANTS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_fp8_gemv_matches_the_dequantized_weight(n, k, block, rows, dtype):
    weight, ref = _fp8(n, k, block)
    data, grid = weight.data.view(torch.uint8), weight.scales.float().contiguous()
    row_scale = torch.rand(n, generator=torch.Generator().manual_seed(1)) + 0.5
    ref = ref * row_scale.double()[:, None]
    for t in range(1, 9):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(dtype)
        out = torch.full((t, n), float("nan"), dtype=dtype, device="cuda")
        ops.fp8_gemv(out, x.cuda(), data, grid, row_scale.cuda(), *block, rows)
        # float32 products and sums over K terms (one scale product per 16), then the output
        # rounding; the error's scale is the root-sum-square of the products
        rss = ((x.double() ** 2) @ (ref ** 2).T).sqrt()
        assert_close(out.cpu(), x.double() @ ref.T, dtype, compute=torch.float32, magnitude=rss,
                     terms=k, msg=f"T={t} rows={rows}")


def test_fp8_gemv_refuses_blocks_that_are_not_a_power_of_two():
    weight, _ = _fp8(64, 192, (64, 96))
    x = torch.zeros(1, 192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="power of two"):
        ops.fp8_gemv(out, x, weight.data.view(torch.uint8), weight.scales.float().contiguous(),
                     torch.ones(64, device="cuda"), 64, 96, 0)


@pytest.mark.parametrize("variant", ("v1", "v2"))
def test_linears_take_the_selected_gemv(variant, monkeypatch):
    """QuantLinear and ScaledLinear give the reference product under either variant."""
    from freetoken.models.config import QuantWeight
    from freetoken.models.forward.linear import QuantLinear
    from freetoken.models.forward.scaled_linear import ScaledLinear

    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", variant)
    qweight, w = _gguf(12, 512)
    linear = QuantLinear(QuantWeight(12, qweight, (N, 512)))
    assert (linear._gemv is not None) == (variant == "v2")
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    out = torch.empty(2, N, device="cuda", dtype=torch.float32)
    linear(out, x)
    _check(out, x, w, gemm=False)
    weight, ref = _fp8(N, 1040, (128, 128))
    scaled_linear = ScaledLinear(weight)
    assert (scaled_linear._fp8 is not None) == (variant == "v2")
    x = torch.randn(4, 1040, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    out = torch.empty(4, N, device="cuda", dtype=torch.bfloat16)
    scaled_linear(out, x.cuda())
    rss = ((x.double() ** 2) @ (ref ** 2).T).sqrt()
    assert_close(out.cpu(), x.double() @ ref.T, torch.bfloat16, compute=torch.float32,
                 magnitude=rss, terms=1040)


# ---------------------------------------------------------------- gguf_gemv_q8 (v3)
# The bounds and the numpy restatement of the int8 activations are the emulated test's
# (tests/kernel/test_gguf_gemv_q8_emulated.py); here the compiled kernel runs them.

Q8_CASES = ([(12, *shape, rows) for shape in ((1, 37, 256), (1, 21, 4096), (2, 19, 2560),
                                               (2, 9, 12288), (1, 4099, 4096), (1, 4099, 2048))
             for rows in (0, 1, 2)]
            + [(qt, *shape, 0) for qt in (2, 3, 6, 7, 8, 13, 14)
               for shape in ((1, 37, 2048), (2, 19, 6144), (2, 9, 12288), (1, 4099, 4096))]
            + [(14, 2, 37, 768, 0)]    # Q6_K rows of 630 bytes, padded to 640 (gpu_rows)
            # 3-8 tokens: Q4_K, Q6_K and Q8_0 (3, 5 with masked tokens; 8 x K at the staging)
            + [(qt, t, 1031, k, 0) for qt, k in ((12, 2048), (12, 4096), (14, 3072), (8, 2048))
               for t in (3, 5, 8)])


@pytest.mark.parametrize("qtype,t,n,k,rows", Q8_CASES,
                         ids=[f"{NAMES[c[0]]}-{c[1]}x{c[3]}x{c[2]}-r{c[4]}" for c in Q8_CASES])
@pytest.mark.parametrize("norm", (False, True), ids=("x", "normed"))
@pytest.mark.parametrize("pdl", (False, True), ids=("launch", "pdl"))
def test_gguf_gemv_q8_matches_the_quantized_product(qtype, t, n, k, rows, norm, pdl):
    from freetoken.models.checkpoint.weights import gpu_rows
    from tests.kernel.test_gguf_gemv_q8_emulated import _case, _normed, q8_bound, quantize_rows

    x, blocks, w, nw, g = _case(t, n, k, seed=n + k + rows, qtype=qtype)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    xn = _normed(x, nw, norm)
    xq = quantize_rows(xn)
    qweight = torch.from_numpy(gpu_rows(blocks)).cuda()
    for out_dtype, with_bias in ((torch.float32, False), (torch.bfloat16, True)):
        whole = torch.full((t, n + 5), float("nan"), dtype=out_dtype, device="cuda")
        out = whole[:, 2:2 + n]
        ops.gguf_gemv_q8(out, x.cuda(), qweight, qtype, bias.cuda() if with_bias else None,
                         nw.cuda() if norm else None, 1e-6, 0, rows, pdl)
        want = xq @ w.T + (bias.double().numpy() if with_bias else 0.0)
        limit = q8_bound(xn, xq, w, blocks, norm, qtype) + 2 * 2.0 ** -7 * np.abs(want)
        err = np.abs(out.double().cpu().numpy() - want)
        assert (err <= limit).all(), f"max error {err.max():.3g} out {out_dtype}"
        assert torch.isnan(whole[:, :2]).all() and torch.isnan(whole[:, 2 + n:]).all()


@pytest.mark.parametrize("qtype", (12, 14, 8), ids=("Q4_K", "Q6_K", "Q8_0"))
@pytest.mark.parametrize("mode", (1, 2), ids=("residual-add", "swiglu"))
def test_gguf_gemv_q8_epilogues_match_the_reference_chain(mode, qtype):
    """Modes 1 and 2 against kernel/reference.py's chain (the same int8 activations) on the
    same blocks: bf16 outputs one rounding apart, plus the f32 order of the sums."""
    from freetoken.kernel import reference
    from tests.kernel.test_gguf_gemv_q8_emulated import _case, q8_bound, quantize_rows

    for t in (1, 2, 8):
        rows = 2 * 24 if mode == 2 else 24
        k = 4096 if t <= 2 else 2048                  # 8 tokens: x within every staging
        x, blocks, w, nw, g = _case(t, rows, k, seed=mode * 10 + t, qtype=qtype)
        base = torch.randn(t, 24, generator=g).to(torch.bfloat16)
        norm = nw if mode == 2 else None
        want = base.clone()
        reference.gguf_gemv_q8(want, x, torch.from_numpy(blocks), qtype, None, norm, 1e-6,
                               mode)
        out = base.cuda()
        ops.gguf_gemv_q8(out, x.cuda(), torch.from_numpy(blocks).cuda(), qtype, None,
                         None if norm is None else norm.cuda(), 1e-6, mode, 0, True)
        lim = q8_bound(x, quantize_rows(x), w, blocks, norm is not None, qtype)
        lim = lim.max() * (4 if mode == 2 else 1) + 4 * 2.0 ** -7 * want.double().abs().numpy()
        if mode == 1:
            # the product is rounded to bf16 before the add: a rounding flip between the two
            # f32 sums moves it by one ulp of the product, which a cancelling sum keeps
            prod = (want.double() - base.double()).abs().numpy()
            lim = lim + 2 * 2.0 ** -7 * prod
        err = (out.cpu().double() - want.double()).abs().numpy()
        assert (err <= lim).all(), f"T={t}: max error {err.max():.3g}"


def test_gguf_gemv_q8_refuses_what_it_does_not_read():
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 4, device="cuda", dtype=torch.float32)
    q4k = torch.zeros(4, 144, device="cuda", dtype=torch.uint8)
    with pytest.raises(Exception, match="gguf_gemv_q8 reads Q4_0 .2., Q4_1 .3., .*got qtype 10"):
        ops.gguf_gemv_q8(out, x, torch.zeros(4, 84, device="cuda", dtype=torch.uint8), 10)
    with pytest.raises(Exception, match="padded to a multiple of 16"):
        ops.gguf_gemv_q8(out, x, torch.zeros(4, 210, device="cuda", dtype=torch.uint8), 14)
    with pytest.raises(Exception, match="mode must be"):
        ops.gguf_gemv_q8(out, x, q4k, 12, mode=3)
    with pytest.raises(Exception, match="float32 out is for mode 0"):
        ops.gguf_gemv_q8(out, x, q4k, 12, mode=1)
    with pytest.raises(Exception, match="at most 8 rows of x"):
        ops.gguf_gemv_q8(torch.empty(9, 4, device="cuda"), x.expand(9, 256).contiguous(), q4k,
                         12)
    with pytest.raises(Exception, match="at most 2 rows of x"):
        ops.gguf_gemv_q8(torch.empty(3, 4, device="cuda"), x.expand(3, 256).contiguous(),
                         torch.zeros(4, 144, device="cuda", dtype=torch.uint8), 2)
    big = torch.zeros(1, 256 * 129, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="32768 values"):
        ops.gguf_gemv_q8(out, big, torch.zeros(4, 144 * 129, device="cuda", dtype=torch.uint8),
                         12)


# ---------------------------------------------------------------- fp8_gemv_fused (v3)

@pytest.mark.parametrize("n, k, block", FP8_CASES)
@pytest.mark.parametrize("mode", (0, 1, 2), ids=("store", "residual-add", "swiglu"))
@pytest.mark.parametrize("norm", (False, True), ids=("x", "normed"))
def test_fp8_gemv_fused_matches_the_reference_chain(n, k, block, mode, norm):
    """Against kernel/reference.py's chain over the same FP8 weight: float32 order of the sums,
    a few flipped normed elements, and the output's rounding."""
    from freetoken.kernel import reference

    rows = n - n % 2
    weight, ref = _fp8(rows, k, block)
    data, grid = weight.data.view(torch.uint8), weight.scales.float().contiguous()
    row_scale = (torch.rand(rows, generator=torch.Generator().manual_seed(2)) + 0.5).cuda()
    nw = (1 + 0.3 * torch.randn(k, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    width = rows // 2 if mode == 2 else rows
    for t in (1, 2, 5):
        x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        base = torch.randn(t, width, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        bias = torch.randn(width, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        bias = bias if mode == 0 else None
        want = base.clone()
        reference.fp8_gemv_fused(want, x, data.cpu(), grid.cpu(), row_scale.cpu(), *block, bias,
                                 nw if norm else None, 1e-6, mode)
        out = base.cuda()
        ops.fp8_gemv_fused(out, x.cuda(), data, grid, row_scale, *block,
                           None if bias is None else bias.cuda(), nw.cuda() if norm else None,
                           1e-6, mode, 0, True)
        w = ref * row_scale.double().cpu()[:, None]
        rss = ((x.double() ** 2) @ (w ** 2).T).sqrt().max()
        flips = 4 * 2.0 ** -7 * float(x.abs().max()) * float(w.abs().max()) * 4 if norm else 0.0
        limit = 32 * 2.0 ** -23 * rss * k ** 0.5 * (4 if mode == 2 else 1) + flips
        err = (out.cpu().double() - want.double()).abs()
        assert (err <= limit + 4 * 2.0 ** -7 * want.double().abs()).all(), (
            f"T={t}: max error {err.max():.3g}")
