"""Prefill over GGUF weights through the dequantizing scratch (forward/dequant.py), without a
GPU: the ops replaced by their torch references, the scratch on the host. The products must
equal the float products of gguf's dequantized weights (exact values on both sides: only the
summation order and the output's bf16 rounding differ); the expert chunks must cover every
slot once, whatever the chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops, reference
from freetoken.models.checkpoint.weights import gpu_rows
from freetoken.models.forward import dequant
from freetoken.models.forward.dequant import DequantScratch, ExpertChunks
from tests.kernel.gguf_random import dequantize, random_blocks
from tests.tolerances import EPS

BF16 = torch.bfloat16
Q4_K, Q6_K, Q8_0 = 12, 14, 8


@pytest.fixture
def host_ops(monkeypatch):
    for name in ("gguf_dequantize", "moe_experts"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    monkeypatch.setattr(DequantScratch, "_by_device", {})


def _bound(x: torch.Tensor, w: np.ndarray) -> np.ndarray:
    """bf16 rounding of the output and of the scratch's weights, f32 order of the sum."""
    mag = np.abs(x.double().numpy()) @ np.abs(w).T
    return 4 * EPS["bfloat16"] * mag


@pytest.mark.parametrize("qtype,n,k", [(Q4_K, 48, 512), (Q6_K, 40, 768), (Q8_0, 33, 256)])
def test_dense_product_equals_the_dequantized_product(host_ops, qtype, n, k):
    rng = np.random.default_rng(n)
    blocks = random_blocks(qtype, n, k, rng)
    data = torch.from_numpy(gpu_rows(blocks))          # Q6_K rows of 3 blocks: padded
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k)).to(BF16)
    scratch = DequantScratch.for_device("cpu")
    scratch.reserve(n * k)
    whole = torch.full((40, n + 6), float("nan"), dtype=BF16)
    out = whole[:, 3:3 + n]                             # a column slice, as PartsLinear's
    dequant.dense_product(out, x, data, qtype, scratch, ops.gguf_dequantize)
    w = dequantize(blocks, qtype).astype(np.float64)
    # the scratch holds the weights in bf16: one rounding of each
    want = x.double().numpy() @ w.T
    err = np.abs(out.double().numpy() - want)
    assert (err <= _bound(x, w) + 1e-30).all(), err.max()
    assert torch.isnan(whole[:, :3]).all() and torch.isnan(whole[:, 3 + n:]).all()


@pytest.mark.parametrize("slots", (5, dequant.EXPERT_CHUNK + 5))
def test_expert_chunks_cover_every_slot_once(host_ops, slots):
    _check_expert_chunks(slots, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots", (5, dequant.EXPERT_CHUNK + 5))
def test_expert_chunks_on_the_gpu(monkeypatch, slots):
    """The same with the kernels: gguf_dequantize into the scratch, moe_experts per chunk."""
    monkeypatch.setattr(DequantScratch, "_by_device", {})
    _check_expert_chunks(slots, "cuda")


def _check_expert_chunks(slots: int, device: str) -> None:
    rng = np.random.default_rng(slots)
    h, inter, k, tokens = 256, 256, 3, 40
    b13 = np.stack([random_blocks(Q4_K, 2 * inter, h, rng) for _ in range(slots)])
    b2 = np.stack([random_blocks(Q6_K, h, inter, rng) for _ in range(slots)])
    w13 = torch.from_numpy(gpu_rows(b13)).to(device)
    w2 = torch.from_numpy(gpu_rows(b2)).to(device)
    g = torch.Generator().manual_seed(slots)
    x = torch.randn(tokens, h, generator=g).to(BF16)
    experts = slots + 2
    emap = torch.full((experts,), -1, dtype=torch.int32)
    emap[:slots] = torch.randperm(slots, generator=g).to(torch.int32)   # two unmapped ids
    ids = torch.randint(0, experts, (tokens, k), generator=g).to(torch.int32)
    wts = torch.rand(tokens, k, generator=g)
    chunks = ExpertChunks(w13, w2, (Q4_K, Q6_K), device)
    chunks.scratch.reserve(chunks.chunk * 3 * h * inter)
    assert chunks.applies(tokens) and not chunks.applies(dequant.MIN_TOKENS)
    out = torch.full((tokens, h), float("nan"), dtype=BF16, device=device)
    workspace = None
    if device != "cpu":
        workspace = torch.empty(ops.moe_workspace_bytes(tokens, k, experts, inter, "bfloat16"),
                                dtype=torch.uint8, device=device)
    chunks(out, x.to(device), ids.to(device), wts.to(device), emap.to(device), workspace)
    out = out.cpu()
    f13 = torch.from_numpy(np.stack([dequantize(b, Q4_K) for b in b13])).to(BF16)
    f2 = torch.from_numpy(np.stack([dequantize(b, Q6_K) for b in b2])).to(BF16)
    want = torch.empty_like(out)
    reference.moe_experts(want, x, f13, f2, ids, wts, emap, None)
    scale = want.float().abs().max()
    # chunked: the per-chunk sums rounded to bf16 once each before the float32 total
    assert (out.float() - want.float()).abs().max() <= 4 * EPS["bfloat16"] * scale


def test_the_plan_counts_the_scratch_of_a_model_with_blocks():
    """The largest dense projection or EXPERT_CHUNK experts, in bf16, joins the workspace of
    a model that keeps GGUF blocks (engine/offload_setup.py), and only then."""
    from types import SimpleNamespace

    from freetoken.engine.offload_setup import workspace_bytes
    from freetoken.models.checkpoint.footprint import WeightBytes

    dense = SimpleNamespace(hidden_size=4096, q_size=4096, kv_size=1024, intermediate_size=12288,
                            moe=None, linear=None)
    assert dequant.scratch_elements(dense) == 2 * 4096 * 12288          # gate_up
    moe = SimpleNamespace(num_experts=128, top_k=8, intermediate_size=768,
                          shared_intermediate_size=0)
    sparse = SimpleNamespace(hidden_size=2048, q_size=4096, kv_size=512, intermediate_size=0,
                             moe=moe, linear=None)
    assert dequant.scratch_elements(sparse) == dequant.EXPERT_CHUNK * 3 * 2048 * 768
    for cfg in (dense, sparse):
        plain = workspace_bytes(cfg, "bfloat16", 512, WeightBytes(1, 0, False))
        assert plain == workspace_bytes(cfg, "bfloat16", 512)
        with_blocks = workspace_bytes(cfg, "bfloat16", 512, WeightBytes(1, 0, True))
        assert with_blocks - plain == 2 * dequant.scratch_elements(cfg)
