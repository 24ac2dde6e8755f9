"""The CUDA experts kernel over GGUF blocks (moe_experts_gguf) against the float64 reference of
test_moe_cuda.py on the same experts dequantized by gguf's own numpy reader.

Random valid blocks of every type the GPU reads (tests/kernel/gguf_random.py), gate/up and down
of equal and of different types. The bounds are test_moe_cuda's (bf16 activations and output,
f32 accumulation), plus, on the prefill path that decodes weight slices to bf16 tiles for the
tensor cores, one bf16 rounding of every weight (reference_experts' weight_unit). A wrong block
decode is off by the size of the output itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops
from tests.kernel.gguf_random import NAMES, dequantize, random_blocks
from tests.kernel.test_moe_cuda import UNIT, check_experts, check_routing, gpu, reference_experts

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
TYPES = [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K]
BF16 = torch.bfloat16


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def quant_experts(qtype: int, slots: int, rows: int, cols: int, rng) -> tuple:
    """(uint8 [slots, rows, row_bytes] on the GPU, float32 values [slots, rows, cols] on it)."""
    blocks = random_blocks(qtype, slots * rows, cols, rng)
    values = dequantize(blocks, qtype).reshape(slots, rows, cols)
    dev = _dev()
    return (torch.from_numpy(blocks.reshape(slots, rows, -1)).to(dev),
            torch.from_numpy(values).to(dev))


def make_case(T, E, K, H, inter, q13, q2, *, slots=None, seed=0, ids=None):
    """(x, (w13 blocks, w13 floats), (w2 blocks, w2 floats), ids, weights, expert_map)."""
    rng = np.random.default_rng(seed)
    g = torch.Generator(device=_dev()).manual_seed(seed)
    slots = slots or E
    x = torch.randn(T, H, device=_dev(), generator=g).to(BF16)
    w13 = quant_experts(q13, slots, 2 * inter, H, rng)
    w2 = quant_experts(q2, slots, H, inter, rng)
    if ids is None:
        ids = torch.rand(T, E, device=_dev(), generator=g).argsort(dim=1)[:, :K]
    ids = ids.to(torch.int32).contiguous()
    weights = torch.rand(T, K, device=_dev(), generator=g) + 0.05
    expert_map = torch.randperm(slots, device=_dev(), generator=g)[:E].to(torch.int32)
    return x, w13, w2, ids, weights, expert_map


def run(case, q13, q2, extra_bytes=0):
    x, (w13, _), (w2, w2f), ids, weights, emap = case
    T, K = ids.shape
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    nbytes = ops.moe_workspace_bytes(T, K, emap.numel(), w2f.shape[2], 2)
    ws = torch.full((nbytes + extra_bytes,), 0xFF, dtype=torch.uint8, device=x.device)
    ops.moe_experts_gguf(out, x, w13, w2, q13, q2, ids, weights, emap, ws)
    return out


def tiled(T, K, E) -> bool:
    """Whether the kernel takes the prefill path (moe_align.cuh make_plan)."""
    return T * K > min(4 * E, 256)


def check(case, q13, q2):
    x, (_, w13f), (_, w2f), ids, weights, emap = case
    T, K = ids.shape
    out = run(case, q13, q2)
    unit = UNIT[BF16] if tiled(T, K, emap.numel()) else 0.0
    check_experts(out, *reference_experts(x, w13f, w2f, ids, weights, emap, weight_unit=unit))


@gpu
@pytest.mark.parametrize("qtype", TYPES, ids=NAMES.get)
@pytest.mark.parametrize("T", [1, 3, 40, 300])
def test_each_type(qtype, T):
    case = make_case(T, 8, 2, 512, 256, qtype, qtype, seed=T * 100 + qtype)
    check(case, qtype, qtype)


@gpu
@pytest.mark.parametrize("q13,q2", [(Q4_K, Q6_K), (Q5_K, Q8_0), (Q4_0, Q4_K), (Q6_K, Q4_1),
                                     (Q5_0, Q6_K), (Q4_K, Q5_1)],
                         ids=lambda q: NAMES[q])
@pytest.mark.parametrize("T", [1, 7, 200])
def test_gate_up_and_down_of_different_types(q13, q2, T):
    case = make_case(T, 8, 2, 256, 256, q13, q2, seed=T + q13 * q2)
    check(case, q13, q2)


@gpu
@pytest.mark.parametrize("T", [1, 4, 300])
def test_qwen3_moe_shape_q4_k_m(T):
    # Qwen3-30B-A3B's expert shape (H 2048, I 768) and 8 experts per token (of 32 here, not
    # 128: the host-side dequantized reference stays small)
    case = make_case(T, 32, 8, 2048, 768, Q4_K, Q6_K, seed=T)
    check(case, Q4_K, Q6_K)


@gpu
@pytest.mark.parametrize("T", [3, 64, 700])
def test_non_identity_map_and_spare_slots(T):
    case = make_case(T, 16, 4, 256, 256, Q8_0, Q4_K, slots=40, seed=7 + T)
    check(case, Q8_0, Q4_K)


@gpu
@pytest.mark.parametrize("T,K", [(1, 1), (300, 2), (1500, 8)])
def test_skewed_routing(T, K):
    ids = torch.arange(60, 60 - K, -1, device=_dev()).repeat(T, 1)  # one segment, many tiles
    case = make_case(T, 64, K, 256, 256, Q4_K, Q5_K, seed=T, ids=ids)
    check(case, Q4_K, Q5_K)


@gpu
def test_deterministic_and_ignores_workspace_contents():
    case = make_case(300, 64, 8, 512, 256, Q4_K, Q6_K, seed=3)
    assert torch.equal(run(case, Q4_K, Q6_K), run(case, Q4_K, Q6_K, extra_bytes=4096))


@gpu
def test_zero_tokens_is_a_no_op():
    case = make_case(0, 8, 2, 256, 256, Q4_0, Q4_0)
    assert run(case, Q4_0, Q4_0).shape == (0, 256)


@gpu
@pytest.mark.parametrize("T", [4, 300])
def test_routing_and_experts_replay_in_a_cuda_graph(T):
    E, K, H, inter = 32, 4, 512, 256
    x, (w13, w13f), (w2, w2f), _, _, emap = make_case(T, E, K, H, inter, Q4_K, Q6_K, seed=11)
    logits = torch.randn(T, E, device=_dev())
    weights = torch.empty(T, K, device=_dev())
    ids = torch.empty(T, K, dtype=torch.int32, device=_dev())
    out = torch.empty_like(x)
    ws = torch.empty(ops.moe_workspace_bytes(T, K, E, inter, 2), dtype=torch.uint8,
                     device=_dev())

    def step():
        ops.moe_topk_softmax(weights, ids, logits, True)
        ops.moe_experts_gguf(out, x, w13, w2, Q4_K, Q6_K, ids, weights, emap, ws)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # load the module outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    unit = UNIT[BF16] if tiled(T, K, E) else 0.0
    for seed in range(3):  # new inputs in the same buffers, then replay
        g = torch.Generator(device=_dev()).manual_seed(100 + seed)
        logits.copy_(torch.randn(T, E, device=_dev(), generator=g))
        x.copy_(torch.randn(T, H, device=_dev(), generator=g).to(BF16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_routing(weights, ids, logits, K, True)
        check_experts(out, *reference_experts(x, w13f, w2f, ids, weights, emap,
                                              weight_unit=unit))


@gpu
@pytest.mark.parametrize("T,K,E", [(4, 2, 8), (300, 8, 64)])   # decode and prefill plans
def test_workspace_bytes_match_the_kernel_exactly(T, K, E):
    x, (w13, _), (w2, _), ids, weights, emap = make_case(T, E, K, 256, 256, Q4_K, Q6_K)
    out = torch.empty_like(x)
    need = ops.moe_workspace_bytes(T, K, E, 256, x.dtype)
    ws = torch.empty(need, dtype=torch.uint8, device=_dev())
    ops.moe_experts_gguf(out, x, w13, w2, Q4_K, Q6_K, ids, weights, emap, ws)
    with pytest.raises(Exception, match=f"workspace must hold at least {need} bytes"):
        ops.moe_experts_gguf(out, x, w13, w2, Q4_K, Q6_K, ids, weights, emap, ws[: need - 1])


@gpu
def test_bad_arguments_name_the_argument():
    case = make_case(4, 8, 2, 256, 256, Q4_K, Q6_K)
    x, (w13, _), (w2, _), ids, weights, emap = case
    out = torch.empty_like(x)
    need = ops.moe_workspace_bytes(4, 2, 8, 256, 2)
    ws = torch.empty(need, dtype=torch.uint8, device=_dev())
    args = [out, x, w13, w2, Q4_K, Q6_K, ids, weights, emap, ws]
    ops.moe_experts_gguf(*args)  # exactly enough is enough

    def bad(index, value, match):
        wrong = list(args)
        wrong[index] = value
        with pytest.raises(Exception, match=match):
            ops.moe_experts_gguf(*wrong)

    bad(9, ws[: need - 1], f"workspace must hold at least {need} bytes")
    bad(4, 10, "w13: GGUF type 10 is not one the GPU reads .Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7")
    bad(5, Q4_0, "w2 must be")                     # Q6_K rows read as Q4_0 rows: wrong width
    bad(2, w13[:, :10], "w13")
    bad(3, w2.view(torch.int8), "w2")
    bad(1, x.float(), "x")
    bad(6, ids.long(), "topk_ids")
    bad(8, emap.cpu(), "expert_map")
    h100 = torch.zeros(4, 100, dtype=BF16, device=_dev())
    with pytest.raises(Exception, match="w13: rows of 256-weight blocks need H a multiple of "
                                       "256, got 100"):
        ops.moe_experts_gguf(h100.clone(), h100, *args[2:])

