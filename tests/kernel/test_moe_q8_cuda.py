"""The MoE decode halves over GGUF experts (moe_q8_gate_up, moe_q8_down) on the GPU: against
gguf's dequantized experts and the documented int8 activations (check_moe, the same check the
CPU-thread run of these kernel bodies passes), with and without the programmatic launch, and
replayed from a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernel.gguf_random import random_blocks
from tests.kernel.test_gguf_gemv_q8_emulated import (EXPERT_MAP, MOE_CASES, TYPES, _batch_routing,
                                                      check_moe, moe_case, padded)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16


def _run(ops, x, p13, p2, q13, q2, ids, wts, accumulate, pdl, out=None, rows=1):
    dev = torch.device("cuda")
    tokens, k = ids.shape
    w13, w2 = torch.from_numpy(p13).to(dev), torch.from_numpy(p2).to(dev)
    ids_d, wts_d = torch.from_numpy(ids).to(dev), torch.from_numpy(wts).to(dev)
    emap = torch.from_numpy(EXPERT_MAP).to(dev)
    inter = w13.shape[1] // 2
    act = torch.full((tokens * k, inter), float("nan"), dtype=BF16, device=dev)
    xd = x.to(dev)
    ops.moe_q8_gate_up(act, xd, w13, q13, ids_d, emap, rows, pdl)
    ops.moe_q8_down(out, act, w2, q2, ids_d, wts_d, emap, accumulate, rows, pdl)
    return act


@pytest.mark.parametrize("q13,q2,h,inter", MOE_CASES,
                         ids=[f"{TYPES[c[0]]}-{TYPES[c[1]]}-{c[2]}x{c[3]}" for c in MOE_CASES])
@pytest.mark.parametrize("tokens", (1, 2, 3))
@pytest.mark.parametrize("accumulate", (False, True), ids=("store", "add"))
@pytest.mark.parametrize("pdl", (False, True), ids=("plain", "pdl"))
@pytest.mark.parametrize("rows", (1, 2), ids=("r1", "r2"))
def test_moe_halves_match_the_quantized_experts(q13, q2, h, inter, tokens, accumulate, pdl,
                                                rows):
    from freetoken.kernel import ops

    x, p13, p2, b13, b2, ids, wts = moe_case(q13, q2, h, inter, tokens)
    whole = torch.randn(tokens, h + 8, generator=torch.Generator().manual_seed(h)).to(BF16)
    residual = whole[:, :h].clone()
    whole = whole.cuda()
    out = whole[:, :h]
    act = _run(ops, x, p13, p2, q13, q2, ids, wts, accumulate, pdl, out, rows)
    torch.cuda.synchronize()
    check_moe(act.cpu(), out.cpu(), x, b13, b2, q13, q2, ids, wts,
              residual if accumulate else None)
    assert torch.isfinite(whole[:, h:]).all()


def test_moe_halves_replay_from_a_cuda_graph():
    """Captured once (ids, weights and act on the device: no host sync), replayed on new
    routes and inputs: the eager result of those."""
    from freetoken.kernel import ops

    q13, q2, h, inter = MOE_CASES[0]
    x, p13, p2, _, _, ids, wts = moe_case(q13, q2, h, inter, 2)
    dev = torch.device("cuda")
    w13, w2 = torch.from_numpy(p13).to(dev), torch.from_numpy(p2).to(dev)
    emap = torch.from_numpy(EXPERT_MAP).to(dev)
    ids_d, wts_d, x_d = (torch.from_numpy(ids).to(dev), torch.from_numpy(wts).to(dev),
                         x.to(dev))
    act = torch.empty(ids.size, inter, dtype=BF16, device=dev)
    out = torch.empty(2, h, dtype=BF16, device=dev)

    def step():
        ops.moe_q8_gate_up(act, x_d, w13, q13, ids_d, emap, 1, True)
        ops.moe_q8_down(out, act, w2, q2, ids_d, wts_d, emap, False, 1, True)

    step()                                        # load the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ids_d.copy_(ids_d.flip(0))                    # new routes, weights and inputs
    wts_d.copy_(wts_d * 0.5)
    x_d.copy_(-x_d)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out) and replayed.abs().max() > 0


@pytest.mark.parametrize("q13,h,inter,tokens", [(12, 2048, 768, 32), (12, 4096, 1024, 8),
                                                (8, 2048, 512, 32), (14, 2048, 512, 16)],
                         ids=["Q4_K-30B-32", "Q4_K-long-8", "Q8_0-32", "Q6_K-16"])
@pytest.mark.parametrize("pdl", (False, True), ids=("plain", "pdl"))
def test_moe_halves_over_a_batchs_routes(q13, h, inter, tokens, pdl):
    """A batch's routes (experts shared by many pairs, some unmapped) at real shapes
    (Qwen3-30B-A3B's H and I; H = 4096 takes Q4_K's long-row kernel): both halves against the
    experts (check_moe), and replayed from a graph on new routes as they run eagerly."""
    from freetoken.kernel import ops

    ids, emap = _batch_routing(tokens)
    k, slots = ids.shape[1], int(emap.max()) + 1
    rng, dev = np.random.default_rng(h), torch.device("cuda")
    b13 = np.stack([random_blocks(q13, 2 * inter, h, rng) for _ in range(slots)])
    b2 = np.stack([random_blocks(q13, h, inter, rng) for _ in range(slots)])
    w13, w2 = torch.from_numpy(padded(b13)).to(dev), torch.from_numpy(padded(b2)).to(dev)
    wts = torch.from_numpy(rng.uniform(0.1, 1, (tokens, k)).astype(np.float32)).to(dev)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(inter)).to(BF16).to(dev)
    ids_d, emap_d = torch.from_numpy(ids).to(dev), torch.from_numpy(emap).to(dev)
    act = torch.full((tokens * k, inter), float("nan"), dtype=BF16, device=dev)
    out = torch.full((tokens, h), float("nan"), dtype=BF16, device=dev)

    def step():
        ops.moe_q8_gate_up(act, x, w13, q13, ids_d, emap_d, 1, pdl)
        ops.moe_q8_down(out, act, w2, q13, ids_d, wts, emap_d, False, 1, pdl)

    step()
    torch.cuda.synchronize()
    check_moe(act.cpu(), out.cpu(), x.cpu(), b13, b2, q13, q13, ids, wts.cpu().numpy(),
              emap=emap)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ids_d.copy_(ids_d.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    replayed_act, replayed = act.clone(), out.clone()
    step()
    torch.cuda.synchronize()
    assert torch.equal(replayed_act.view(torch.int16), act.view(torch.int16))
    assert torch.equal(replayed, out)


def test_moe_halves_refuse_bad_operands():
    from freetoken.kernel import ops

    q13, q2, h, inter = MOE_CASES[1]
    x, p13, p2, _, _, ids, wts = moe_case(q13, q2, h, inter, 1)
    dev = torch.device("cuda")
    w13, w2 = torch.from_numpy(p13).to(dev), torch.from_numpy(p2).to(dev)
    ids_d, wts_d = torch.from_numpy(ids).to(dev), torch.from_numpy(wts).to(dev)
    emap = torch.from_numpy(EXPERT_MAP).to(dev)
    act = torch.empty(3, inter, dtype=BF16, device=dev)
    with pytest.raises(Exception, match="act must be"):
        ops.moe_q8_gate_up(act[:2], x.to(dev), w13, q13, ids_d, emap)
    with pytest.raises(Exception, match="w13 must be"):
        ops.moe_q8_gate_up(act, x.to(dev), w13[:, :, :-16].contiguous(), q13, ids_d, emap)
    out = torch.empty(1, h, dtype=BF16, device=dev)
    with pytest.raises(Exception, match="topk_weights"):
        ops.moe_q8_down(out, act, w2, q2, ids_d, wts_d[:, :2].contiguous(), emap)
    with pytest.raises(Exception, match="GGUF|qtype"):
        ops.moe_q8_down(out, act, w2, 9, ids_d, wts_d, emap)
