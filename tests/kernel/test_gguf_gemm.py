"""gguf_gemm on the GPU (GEMV for decode, tensor-core GEMM for prefill, the row gather) against
torch on the weights that gguf's numpy dequantizer reads from the same blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from tests.kernel.gguf_random import BLOCKS, NAMES, dequantize, random_blocks
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QTYPES = sorted(BLOCKS)
# M <= 8 takes the GEMV, larger M the tiled GEMM (ragged edges in M and N on purpose).
ROWS = (1, 3, 8, 9, 64, 131)


def _case(qtype: int, n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    blocks = random_blocks(qtype, n, k, rng)
    w = torch.from_numpy(dequantize(blocks, qtype)).double()
    return torch.from_numpy(blocks).cuda(), w


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, gemm: bool) -> None:
    """Error bound per element from |x| @ |w|.T: the GEMV decodes weights exactly and adds in
    float32 (K terms); the GEMM rounds each weight to bf16 first (half a bf16 ulp each) and
    adds in float32; then one rounding to out's dtype."""
    xd = x.double().cpu()
    ref = xd @ w.T
    scale = xd.abs() @ w.abs().T
    k = x.shape[1]
    rel = (EPS["bfloat16"] / 2 if gemm else 0.0) + k * EPS["float32"]
    tol = 2 * rel * scale + 2 * EPS[str(out.dtype).replace("torch.", "")] * ref.abs() + 1e-30
    err = (out.double().cpu() - ref).abs()
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound (max err {err.max().item():.3g})"
    assert ref.abs().max() > 0


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", ROWS)
def test_matmul_matches_torch_on_dequantized_weights(qtype, m):
    n, k = 200, 1024
    qweight, w = _case(qtype, n, k, seed=qtype * 100 + m)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m))).to("cuda", torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
        ops.gguf_matmul(out, x, qweight, qtype)
        _check(out, x, w, gemm=m > 8)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: NAMES[t])
def test_rows_that_are_not_16_byte_multiples(qtype):
    """One block per row (18, 20, 22, 24, 34, 144, 176, 210 bytes): the GEMV's 2-byte staging
    path."""
    n, k = 37, BLOCKS[qtype][0]
    qweight, w = _case(qtype, n, k, seed=7)
    for m in (1, 5, 20):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float32)
        ops.gguf_matmul(out, x, qweight, qtype)
        _check(out, x, w, gemm=m > 8)


@pytest.mark.parametrize("m", (2, 40))
def test_writes_a_column_slice_of_a_wider_output(m):
    """Mixed-type row parts (Q4_K q/k, Q6_K v) write straight into their fused columns."""
    k = 512
    parts = [_case(12, 96, k, 1), _case(14, 32, k, 2)]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    out = torch.full((m, 128 + 8), 7.0, device="cuda", dtype=torch.bfloat16)
    ops.gguf_matmul(out[:, :96], x, parts[0][0], 12)
    ops.gguf_matmul(out[:, 96:128], x, parts[1][0], 14)
    _check(out[:, :128], x, torch.cat([parts[0][1], parts[1][1]]), gemm=m > 8)
    assert (out[:, 128:] == 7.0).all()        # nothing written past the slice


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: NAMES[t])
def test_dequantize_rows_gathers_embedding_rows(qtype):
    vocab, k = 50, 512
    qweight, w = _case(qtype, vocab, k, seed=11)
    ids = torch.tensor([3, 0, 49, 3, 50, -1], device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((len(ids), k), float("nan"), device="cuda", dtype=dtype)
        ops.gguf_dequantize_rows(out, ids, qweight, qtype)
        expected = torch.cat([w[[3, 0, 49, 3]], torch.zeros(2, k, dtype=torch.float64)])
        torch.testing.assert_close(out.cpu(), expected.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: NAMES[t])
@pytest.mark.parametrize("k", (256, 768), ids=("k256", "k768"))
def test_dequantize_writes_the_whole_weight_in_bf16(qtype, k):
    """gguf_dequantize (prefill's scratch weights): gguf's values rounded once to bf16 (the
    block reader agrees with gguf to a float32 ulp, which may flip a bf16 rounding: one bf16
    ulp), from rows as the loader keeps them (padded to 16-byte words: Q6_K's 630-byte rows of
    k = 768) and as the file has them."""
    from freetoken.models.checkpoint.weights import gpu_rows

    blocks = random_blocks(qtype, 37, k, np.random.default_rng(k + qtype))
    want = torch.from_numpy(dequantize(blocks, qtype)).to(torch.bfloat16)
    for rows in {blocks.shape[1]: blocks, gpu_rows(blocks).shape[1]: gpu_rows(blocks)}.values():
        out = torch.full((37, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        ops.gguf_dequantize(out, torch.from_numpy(np.ascontiguousarray(rows)).cuda(), qtype)
        torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2.0 ** -7, atol=0,
                                   msg=f"rows of {rows.shape[1]} bytes")


def test_bad_arguments_raise_named_errors():
    qweight, _ = _case(12, 16, 256, 0)
    x = torch.zeros(1, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, 16, device="cuda", dtype=torch.float32)
    with pytest.raises(Exception, match="qtype 10 is not a GGUF type the GPU reads .Q4_0 2, "
                                       "Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8"):
        ops.gguf_matmul(out, x, qweight, 10)
    with pytest.raises(Exception, match="x must be bfloat16"):
        ops.gguf_matmul(out, x.float(), qweight, 12)
    with pytest.raises(Exception, match="qweight rows must hold 512"):
        ops.gguf_matmul(out, torch.zeros(1, 512, device="cuda", dtype=torch.bfloat16), qweight, 12)


def test_decode_gemv_replays_in_a_cuda_graph():
    qweight, w = _case(12, 256, 1024, 5)
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
    out = torch.zeros(1, 256, device="cuda", dtype=torch.float32)
    ops.gguf_matmul(out, x, qweight, 12)                # load the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gguf_matmul(out, x, qweight, 12)
    x.copy_(torch.randn(1, 1024, device="cuda").to(torch.bfloat16))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, w, gemm=False)
