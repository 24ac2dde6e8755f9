"""The expert cache over GGUF experts kept in their blocks (expert_pool.BlockPool) on the CPU:
torch CPU tensors stand in for the GPU pool and kernel/reference.py's moe_q8 halves and
moe_experts_quant for the kernels. Layers of three type mixes (a _K_M mix's Q6_K down rows,
all Q4_K, all Q8_0) share one pool of slots sized for the widest. Every step must give
exactly what the same kernels give over the resident stacked blocks with the identity map:
the slots, evictions, staging and streaming only move bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.engine.expert_cache import ExpertCache
from freetoken.engine.expert_pool import BlockKernels, BlockPool
from freetoken.kernel import reference
from freetoken.models.checkpoint.weights import gpu_rows
from tests.kernel.gguf_random import random_blocks

E, H, I, K = 8, 256, 256, 2
Q4_K, Q6_K, Q8_0 = 12, 14, 8
QTYPES = [(Q4_K, Q6_K), (Q4_K, Q4_K), (Q8_0, Q8_0)]
LAYERS = len(QTYPES)


def experts_gguf(out, x, w13, w2, q13, q2, ids, weights, expert_map, workspace):
    """moe_experts_gguf's contract: the slots' blocks dequantized, then moe_experts."""
    def floats(w, qtype):
        return torch.stack([reference.dequantize(w[s].contiguous(), qtype)
                            for s in range(w.shape[0])])

    reference.moe_experts(out, x, floats(w13, q13), floats(w2, q2), ids, weights, expert_map,
                          workspace)


KERNELS = BlockKernels(reference.moe_q8_gate_up, reference.moe_q8_down, experts_gguf, None)


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    w13, w2 = [], []
    for q13, q2 in QTYPES:
        w13.append(torch.from_numpy(gpu_rows(np.stack(
            [random_blocks(q13, 2 * I, H, rng, centered=True) for _ in range(E)]))))
        w2.append(torch.from_numpy(gpu_rows(np.stack(
            [random_blocks(q2, H, I, rng, centered=True) for _ in range(E)]))))
    return w13, w2


def make_cache(experts, slots):
    w13, w2 = experts
    return ExpertCache(BlockPool(w13, w2, QTYPES, H, I, KERNELS), "cpu", slots)


def resident(experts, layer, x, ids, weights, out=None, accumulate=False):
    """The same kernels over the layer's stacked blocks with the identity map."""
    w13, w2 = experts[0][layer], experts[1][layer]
    q13, q2 = QTYPES[layer]
    identity = torch.arange(E, dtype=torch.int32)
    out = torch.zeros(x.shape, dtype=x.dtype) if out is None else out.clone()
    if x.shape[0] > 32:
        experts_gguf(out, x, w13, w2, q13, q2, ids, weights, identity, None)
        return out
    act = torch.empty(x.shape[0] * K, I, dtype=x.dtype)
    reference.moe_q8_gate_up(act, x, w13, q13, ids, identity)
    reference.moe_q8_down(out, act, w2, q2, ids, weights, identity, accumulate)
    return out


def routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    return ids.to(torch.int32), w / w.sum(1, keepdim=True)


def step(cache, experts, tokens, seed, accumulate=False):
    for layer in range(LAYERS):
        g = torch.Generator().manual_seed(seed * 10 + layer)
        x = (torch.randn(tokens, H, generator=g) * 0.5).to(torch.bfloat16)
        ids, weights = routing(tokens, seed * 10 + layer)
        base = torch.randn(tokens, H, generator=g).to(torch.bfloat16)
        out = base.clone() if accumulate else torch.full_like(x, float("nan"))
        workspace = torch.empty(2 * tokens * K * I * 2, dtype=torch.uint8)
        cache.run(layer, out, x, ids, weights, workspace, accumulate)
        want = resident(experts, layer, x, ids, weights, base if accumulate else None,
                        accumulate)
        assert torch.equal(out, want), f"layer {layer}, {tokens} tokens, step {seed}"
    cache.check_integrity()


def test_one_slot_holds_the_widest_expert_and_the_host_keeps_the_blocks(experts):
    cache = make_cache(experts, 5)
    pool = cache.pool
    widest = max(a[0].numel() + b[0].numel() for a, b in zip(*experts))
    assert pool.slot_bytes == -(-widest // 256) * 256 and cache.expert_bytes == pool.slot_bytes
    assert pool.pool.dtype == torch.uint8 and pool.pool.shape == (5 + 2 * E, pool.slot_bytes)
    assert cache.pinned_bytes == sum(a.numel() + b.numel() for a, b in zip(*experts))
    assert cache.in_format


@pytest.mark.parametrize("slots", [K, 5, 12, E * LAYERS])
def test_decode_through_the_slots_gives_the_resident_blocks_output(experts, slots):
    cache = make_cache(experts, slots)
    cache.prefill = False
    for seed in range(6):
        step(cache, experts, 1 + seed % 3, seed)
    assert cache.stats.misses > 0
    assert cache.stats.bytes_h2d % 16 == 0 and cache.stats.bytes_h2d > 0


def test_misses_beyond_the_free_slots_go_through_staging_in_slot_layout(experts):
    cache = make_cache(experts, K)                 # one layer's top-k only
    cache.prefill = False
    step(cache, experts, 3, 1)                     # 6 pairs over K slots: overflow
    step(cache, experts, 1, 2)


@pytest.mark.parametrize("tokens", [3, 40])
def test_streamed_layers_are_packed_in_the_staging_bytes(experts, tokens):
    """Prompt steps stream whole layers: a short one through the decode kernels over the
    packed staging buffer, a wide one (> 32 tokens) through moe_experts_gguf's contract."""
    cache = make_cache(experts, 4)
    cache.prefill = True
    step(cache, experts, tokens, 3)
    assert len(cache.lru) == 0 and cache.stats.streamed_layers == LAYERS
    cache.prefill = False                           # the staging is reused by decode after
    step(cache, experts, 2, 4)


def test_a_decode_step_wider_than_the_kernels_take_streams(experts):
    cache = make_cache(experts, E * LAYERS)
    cache.prefill = None                            # T * K < E would map; 40 tokens stream
    step(cache, experts, 40, 5)
    assert cache.stats.streamed_layers == LAYERS


def test_the_residual_add_of_the_fused_decode(experts):
    cache = make_cache(experts, 6)
    cache.prefill = False
    for seed in range(3):
        step(cache, experts, 2, 10 + seed, accumulate=True)


def test_resize_keeps_the_slots_that_fit_and_serves_on(experts):
    cache = make_cache(experts, 16)
    cache.prefill = False
    for seed in range(4):
        step(cache, experts, 2, 20 + seed)
    cache.resize(5)
    assert cache.pool.pool.shape[0] == 5 + 2 * E and len(cache.lru) <= 5
    for seed in range(4):
        step(cache, experts, 2, 30 + seed)
    cache.resize(20)
    step(cache, experts, 3, 40)


def test_graph_segments_route_through_the_block_slots(experts):
    """As segment_graphs drives it: the hook reads the ids, places the misses and uploads the
    map before the kernel that the segment replays."""
    cache = make_cache(experts, 6)
    cache.prefill = False
    cache.segment_hook = cache.prepare_segment
    for seed in range(4):
        step(cache, experts, 2, 50 + seed)
    assert cache.stats.tokens == 4 * 2


def test_cpu_block_experts_sums_the_chosen_experts_pairs(experts):
    """The CPU side of co-execution over blocks: the CPU experts kernel on the host blocks
    (rows padded as the GPU keeps them) for the pairs routed to the chosen experts only, against
    the dequantized experts in float64."""
    from freetoken.engine.offload_policy import block_runner, cpu_kernel_experts, \
        measure_cpu_kernel
    from freetoken.kernel import ops

    kernel = ops.bind("moe_experts_quant", "cpu")
    layer = 0                                      # Q4_K gate/up, Q6_K down: padded rows
    w13, w2 = experts[0][layer], experts[1][layer]
    q13, q2 = QTYPES[layer]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, H, generator=g)
    ids, weights = routing(5, 8)
    chosen = sorted({int(ids[0, 0]), int(ids[3, 1])})
    run = block_runner(w13, w2, q13, q2, kernel)
    got = cpu_kernel_experts(x, ids, weights, chosen, run)
    f13 = torch.stack([reference.dequantize(w13[e], q13) for e in range(E)]).double()
    f2 = torch.stack([reference.dequantize(w2[e], q2) for e in range(E)]).double()
    want = torch.zeros(5, H, dtype=torch.float64)
    scale = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for k in range(K):
            e = int(ids[t, k])
            if e not in chosen:
                continue
            gu = f13[e] @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            want[t] += float(weights[t, k]) * (f2[e] @ act)
            scale[t] += float(weights[t, k]) * (f2[e].abs() @ act.abs())
    # int8 activations (x, then act) and float32 sums: a few 1/127 steps of each magnitude
    assert (got.double() - want).abs().le(0.05 * scale + 1e-6).all()
    assert got[[t for t in range(5) if not set(ids[t].tolist()) & set(chosen)]].eq(0).all()
    bandwidth, flops = measure_cpu_kernel(torch, run, H, I, w13[0].numel() + w2[0].numel(),
                                          repeats=1)
    assert bandwidth > 0 and flops > 0


def test_co_execution_computes_some_misses_on_the_cpu_over_the_blocks(experts):
    """A policy that finds the CPU fast hands it most misses: the layer's output is the GPU
    kernel's part (the copied and cached experts) plus the CPU kernel's part over the same host
    blocks; against the resident blocks, each co-executed layer moves by int8 roundings only
    (the CPU kernel quantizes x and act per 32 values as the GPU's does, but sums in another
    order), never by a missing or doubled expert."""
    from freetoken.engine.expert_pool import BlockKernels
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput
    from freetoken.kernel import ops

    w13, w2 = experts
    kernels = BlockKernels(reference.moe_q8_gate_up, reference.moe_q8_down, experts_gguf, None,
                           ops.bind("moe_experts_quant", "cpu"))
    policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14), 100_000, 6 * H * I)
    cache = ExpertCache(BlockPool(w13, w2, QTYPES, H, I, kernels), "cpu", 4, policy)
    cache.prefill = False
    for seed in range(3):
        for layer in range(LAYERS):
            g = torch.Generator().manual_seed(seed * 10 + layer)
            x = (torch.randn(2, H, generator=g) * 0.5).to(torch.bfloat16)
            ids, weights = routing(2, 70 + seed * 10 + layer)
            out = torch.full_like(x, float("nan"))
            workspace = torch.empty(2 * 2 * K * I * 2, dtype=torch.uint8)
            cache.run(layer, out, x, ids, weights, workspace)
            want = resident(experts, layer, x, ids, weights).double()
            scale = want.abs().amax(1, keepdim=True)
            assert ((out.double() - want).abs() <= 0.05 * scale + 1e-6).all(), (seed, layer)
    assert cache.stats.cpu_experts > 0 and cache.stats.misses > cache.stats.cpu_experts
    cache.check_integrity()


def test_driver_copy_spans_move_the_bytes_torch_copies_move(experts):
    """Both block mixes: a Q6_K layer's wider down rows end where the slot's bytes do."""
    from tests.engine.driver_spans import assert_spans_copy_as_torch

    w13, w2 = experts
    moves = [(layer, (3 * layer + 1) % E, layer) for layer in range(LAYERS)] + [(0, E - 1, 2)]
    assert_spans_copy_as_torch(lambda: BlockPool(w13, w2, QTYPES, H, I, KERNELS), 4, moves)
