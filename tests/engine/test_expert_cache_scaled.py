"""The expert cache over FP8 experts kept in their format (expert_pool.ScaledPool) on the CPU:
torch CPU tensors stand in for the GPU pool and kernel/reference.py's moe_experts_scaled (over
the slots a step reads), scaled_dequantize and moe_experts for the kernels. Two layouts:
128x128 scale blocks without row scales (DeepSeek/Qwen FP8: the pool's row scales are ones)
and per-row grids of 64 columns with row scales (copied with each expert). Every step must
give exactly what the same kernels give over the resident stacked experts with the identity
map (scaled_moe.ScaledExperts, as a resident FP8 layer runs): the slots, evictions, staging
and streaming only move bytes."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from freetoken.engine.expert_cache import ExpertCache
from freetoken.engine.expert_pool import ScaledPool
from freetoken.kernel import reference
from freetoken.models.forward.scaled_linear import GEMV_MAX_TOKENS
from freetoken.models.forward.scaled_moe import ScaledExperts, ScaledKernels
from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import quantize_fp8

E, H, I, K = 8, 128, 128, 2
LAYERS = 3


def routed_slots_only(out, x, w13, s13, r13, w2, s2, r2, fmt, bn13, bk13, bn2, bk2, ids,
                      weights, expert_map, act):
    """reference.moe_experts_scaled over the slots the pairs read, renumbered (the reference
    dequantizes every slot it is given, up to S + 2E here, slowly): the same values."""
    mapped = expert_map[ids.long()]
    used = torch.unique(mapped[mapped >= 0])
    local = torch.full_like(expert_map, -1)
    for e in torch.unique(ids.long()).tolist():
        if expert_map[e] >= 0:        # -1: co-execution computes it on the CPU (skipped here)
            local[e] = int(torch.searchsorted(used, expert_map[e]))
    picked = [t[used.long()] for t in (w13, s13, r13, w2, s2, r2)]
    reference.moe_experts_scaled(out, x, *picked[:3], *picked[3:], fmt, bn13, bk13, bn2, bk2,
                                 ids, weights, local, act)


KERNELS = ScaledKernels(routed_slots_only, reference.scaled_dequantize, reference.moe_experts)


def fp8_stack(rows: int, cols: int, layout: str, gen: torch.Generator) -> scaled.ScaledWeight:
    """Random experts [E, rows, cols] in FP8 with the layout's scales."""
    w = torch.randn(E, rows, cols, generator=gen) * 0.05
    if layout == "block":
        q, grid = quantize_fp8(w, 128, 128)
        return scaled.ScaledWeight(scaled.FP8, q, grid, (E, rows, cols), (128, 128))
    q, grid = quantize_fp8(w, 1, 64)
    row_scale = torch.rand(E, rows, generator=gen) + 0.5
    return scaled.ScaledWeight(scaled.FP8, q, grid, (E, rows, cols), (1, 64), row_scale)


@pytest.fixture(scope="module", params=["block", "rows"])
def experts(request):
    """Per layer: w13 [E, 2I, H] (gate and up joined as the reader joins them) and w2."""
    gen = torch.Generator().manual_seed(0)
    w13, w2 = [], []
    for _ in range(LAYERS):
        gate, up = (fp8_stack(I, H, request.param, gen) for _ in range(2))
        w13.append(scaled.concat_rows([gate, up]))
        w2.append(fp8_stack(H, I, request.param, gen))
    return w13, w2


def make_cache(experts, slots, policy=None):
    w13, w2 = experts
    return ExpertCache(ScaledPool(w13, w2, K, KERNELS), "cpu", slots, policy)


def resident(experts, layer, x, ids, weights):
    """The same kernels over the layer's stacked experts with the identity map."""
    out = torch.zeros(x.shape, dtype=x.dtype)
    run = ScaledExperts(experts[0][layer], experts[1][layer], K, KERNELS)
    run(out, x, ids, weights, torch.arange(E, dtype=torch.int32), torch.empty(0))
    return out


def routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    return ids.to(torch.int32), w / w.sum(1, keepdim=True)


def step(cache, experts, tokens, seed):
    for layer in range(LAYERS):
        g = torch.Generator().manual_seed(seed * 10 + layer)
        x = (torch.randn(tokens, H, generator=g) * 0.5).to(torch.bfloat16)
        ids, weights = routing(tokens, seed * 10 + layer)
        out = torch.full_like(x, float("nan"))
        cache.run(layer, out, x, ids, weights, torch.empty(0))
        want = resident(experts, layer, x, ids, weights)
        assert torch.equal(out, want), f"layer {layer}, {tokens} tokens, step {seed}"
    cache.check_integrity()


def host_expert_bytes(weight) -> int:
    """One expert's bytes as the host keeps them: values, scale grid, row scales if any."""
    parts = (weight.data, weight.scales, weight.row_scale)
    return sum(t[0].numel() * t[0].element_size() for t in parts if t is not None)


def test_slots_hold_the_fp8_values_and_scales(experts):
    w13, w2 = experts
    cache = make_cache(experts, 5)
    pool = cache.pool
    values, grid13, rows13, _, grid2, rows2 = pool.parts
    assert values.dtype == torch.float8_e4m3fn and values.shape == (5 + 2 * E, 2 * I, H)
    assert grid13.dtype == torch.float32 and grid13.shape[1:] == w13[0].scales.shape[1:]
    assert rows13.shape == (5 + 2 * E, 2 * I) and rows2.shape == (5 + 2 * E, H)
    if w13[0].row_scale is None:      # ones the kernel reads, never copied
        assert torch.equal(rows13, torch.ones_like(rows13))
    # a slot: an expert's FP8 bytes, its float32 grids and a float32 row scale per row
    assert pool.slot_bytes == 3 * H * I + 4 * (grid13[0].numel() + grid2[0].numel()) + \
        4 * (2 * I + H) == cache.expert_bytes
    assert pool.slot_bytes < 3 * H * I * 2 * 0.6        # bf16 floats: 2 bytes a weight
    assert cache.pinned_bytes == E * sum(host_expert_bytes(a) + host_expert_bytes(b)
                                         for a, b in zip(w13, w2))
    assert cache.in_format and not cache.fuses_decode
    assert cache.max_mapped_tokens == GEMV_MAX_TOKENS
    # every miss copies the host's bytes of one expert (no row scales where it has none)
    cache.prefill = False
    step(cache, experts, 1, 0)
    assert cache.stats.bytes_h2d == cache.stats.misses * (host_expert_bytes(w13[0]) +
                                                          host_expert_bytes(w2[0]))


@pytest.mark.parametrize("slots", [K, 5, 12, E * LAYERS])
def test_decode_through_the_slots_gives_the_resident_output(experts, slots):
    cache = make_cache(experts, slots)
    cache.prefill = False
    for seed in range(6):
        step(cache, experts, 1 + seed % 3, seed)
    assert cache.stats.misses > 0 and cache.stats.bytes_h2d > 0


def test_misses_beyond_the_free_slots_go_through_staging(experts):
    cache = make_cache(experts, K)                 # one layer's top-k only
    cache.prefill = False
    step(cache, experts, 3, 1)                     # 6 pairs over K slots: overflow
    step(cache, experts, 1, 2)


@pytest.mark.parametrize("tokens", [3, 12])
def test_streamed_layers_run_over_their_staging_slots(experts, tokens):
    """Prompt steps stream whole layers: a short one through moe_experts_scaled over the
    staging buffer's E slots, a wide one (> GEMV_MAX_TOKENS) dequantizing those E slots."""
    cache = make_cache(experts, 4)
    cache.prefill = True
    step(cache, experts, tokens, 3)
    assert len(cache.lru) == 0 and cache.stats.streamed_layers == LAYERS
    cache.prefill = False                           # the staging is reused by decode after
    step(cache, experts, 2, 4)


def test_a_decode_step_wider_than_the_kernel_takes_streams(experts):
    cache = make_cache(experts, E * LAYERS)
    cache.prefill = False                           # a decode-only step of 12 sequences
    step(cache, experts, GEMV_MAX_TOKENS + 4, 5)
    assert cache.stats.streamed_layers == LAYERS and cache.stats.misses == 0
    pool, x = cache.pool, torch.zeros(GEMV_MAX_TOKENS + 1, H, dtype=torch.bfloat16)
    ids, weights = routing(x.shape[0], 6)
    with pytest.raises(ValueError, match="stream it"):
        pool.run_mapped(0, torch.empty_like(x), x, ids, weights, cache.maps_dev[0], None)


def test_resize_keeps_the_slots_that_fit_and_serves_on(experts):
    cache = make_cache(experts, 16)
    cache.prefill = False
    for seed in range(4):
        step(cache, experts, 2, 20 + seed)
    cache.resize(5)
    assert all(part.shape[0] == 5 + 2 * E for part in cache.pool.parts)
    assert len(cache.lru) <= 5
    for seed in range(4):
        step(cache, experts, 2, 30 + seed)
    cache.resize(20)
    step(cache, experts, 3, 40)
    cache.prefill = True
    step(cache, experts, 12, 41)


def test_graph_segments_route_through_the_fp8_slots(experts):
    """As segment_graphs drives it: the hook reads the ids, places the misses and uploads the
    map before the kernel that the segment replays."""
    cache = make_cache(experts, 6)
    cache.prefill = False
    cache.segment_hook = cache.prepare_segment
    for seed in range(4):
        step(cache, experts, 2, 50 + seed)
    assert cache.stats.tokens == 4 * 2


def test_co_execution_without_a_cpu_kernel_and_the_fused_residual_add_are_refused(experts):
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput

    policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14), 1000, 1000)
    with pytest.raises(ValueError, match="was given no CPU kernel"):
        make_cache(experts, 4, policy)
    cache = make_cache(experts, 4)
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    ids, weights = routing(1, 7)
    with pytest.raises(AssertionError, match="no fused residual add"):
        cache.run(0, torch.zeros_like(x), x, ids, weights, None, accumulate=True)


def decoded(weight) -> torch.Tensor:
    """float64 values of stacked FP8 experts, bit by bit (numpy, not the module under test)."""
    from tests.models.scaled_checkpoint import e4m3_values, expand

    bn, bk = weight.block
    _, rows, cols = weight.shape
    values = e4m3_values(weight.data.view(torch.uint8).numpy()) * expand(
        weight.scales.double().numpy(), bn, bk, rows, cols)
    if weight.row_scale is not None:
        values = values * weight.row_scale.double().numpy()[..., None]
    return torch.from_numpy(values)


def test_cpu_experts_sum_the_chosen_experts_pairs_over_the_fp8_bytes(experts):
    """Co-execution's CPU side over FP8: the CPU's moe_experts_scaled on the host experts the
    cache copies, for the pairs routed to the chosen experts only, against the decoded experts
    in float64 (float32 sums through H then I terms)."""
    from freetoken.engine.offload_policy import cpu_kernel_experts, measure_cpu_kernel, \
        scaled_runner
    from freetoken.kernel import ops
    from tests.tolerances import assert_close

    w13, w2 = experts[0][1], experts[1][1]
    run = scaled_runner(w13, w2, ops.bind("moe_experts_scaled", "cpu"))
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(7))
    ids, weights = routing(5, 8)
    chosen = sorted({int(ids[0, 0]), int(ids[3, 1])})
    got = cpu_kernel_experts(x, ids, weights, chosen, run)
    f13, f2 = decoded(w13), decoded(w2)
    want = torch.zeros(5, H, dtype=torch.float64)
    scale = torch.zeros(5, H, dtype=torch.float64)
    for t in range(5):
        for k in range(K):
            e = int(ids[t, k])
            if e in chosen:
                gu = f13[e] @ x[t].double()
                act = torch.nn.functional.silu(gu[:I]) * gu[I:]
                want[t] += float(weights[t, k]) * (f2[e] @ act)
                magnitude = (f13[e].abs() @ x[t].double().abs())
                scale[t] += float(weights[t, k]) * (f2[e].abs() @ (magnitude[:I] * magnitude[I:]))
    assert_close(got, want, torch.float32, magnitude=scale, terms=H + I)
    assert got[[t for t in range(5) if not set(ids[t].tolist()) & set(chosen)]].eq(0).all()
    bandwidth, flops = measure_cpu_kernel(torch, run, H, I, host_expert_bytes(w13) +
                                          host_expert_bytes(w2), repeats=1)
    assert bandwidth > 0 and flops > 0


def test_co_execution_computes_some_fp8_misses_on_the_cpu(experts):
    """A policy that finds the CPU fast hands it most misses: each layer's output is the
    pool's part (copied and cached experts, through the reference kernels here) plus the CPU
    kernel's part over the same host bytes, each rounded to bf16 before the sum: against the
    resident layer (one rounding), a few bf16 roundings of the experts' outputs, never a
    missing or doubled expert (which moves the result by a whole expert's output)."""
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput
    from freetoken.kernel import ops
    from tests.tolerances import assert_close

    w13, w2 = experts
    policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14), 100_000, 6 * H * I)
    pool = ScaledPool(w13, w2, K, KERNELS, ops.bind("moe_experts_scaled", "cpu"))
    cache = ExpertCache(pool, "cpu", 4, policy)
    cache.prefill = False
    for seed in range(3):
        for layer in range(LAYERS):
            g = torch.Generator().manual_seed(seed * 10 + layer)
            x = (torch.randn(2, H, generator=g) * 0.5).to(torch.bfloat16)
            ids, weights = routing(2, 70 + seed * 10 + layer)
            out = torch.full_like(x, float("nan"))
            cache.run(layer, out, x, ids, weights, torch.empty(0))
            want = resident(experts, layer, x, ids, weights).double()
            assert_close(out, want, torch.bfloat16, ulps=3,
                         magnitude=want.abs().amax(1, keepdim=True), msg=f"{seed} {layer}")
    assert cache.stats.cpu_experts > 0 and cache.stats.misses > cache.stats.cpu_experts
    cache.check_integrity()


def test_the_pool_takes_one_fp8_layout_in_every_layer(experts):
    w13, w2 = experts
    assert ScaledPool.takes(w13, w2)
    other = replace(w2[1], scales=torch.cat([w2[1].scales, w2[1].scales], dim=-2))
    assert not ScaledPool.takes(w13, [w2[0], other, w2[2]])
    assert not ScaledPool.takes(w13, w2[:2])
    floats = [scaled.dequantize(w) for w in w2]
    assert not ScaledPool.takes(w13, floats)
    with pytest.raises(ValueError, match="one format and layout"):
        ScaledPool(w13, floats, K, KERNELS)


# ---- the model's MoE layers ----------------------------------------------------------------

def fp8_moe_layer(experts, monkeypatch):
    """A MoEMLP over layer 0's FP8 experts (the kernels: the references) and its work views."""
    from freetoken.arrays import TorchArrays, parse_device
    from freetoken.kernel import ops
    from freetoken.models.forward.mlp import MoEMLP

    for name in ("moe_experts_scaled", "moe_experts", "scaled_dequantize"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    arrays = TorchArrays(parse_device("cpu"))
    cfg = types.SimpleNamespace(moe=types.SimpleNamespace(
        top_k=K, renormalize=True, num_experts=E, shared_intermediate_size=0))
    kernels = types.SimpleNamespace(arg=arrays.kernel_arg,
                                    moe_topk_softmax=reference.moe_topk_softmax)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    w = {"router": router, "experts.gate_up": experts[0][0], "experts.down": experts[1][0]}
    mlp = MoEMLP(w, cfg, kernels, arrays)
    views = types.SimpleNamespace(other=torch.empty_like,
                                  router_logits=torch.empty(3, E, dtype=torch.bfloat16),
                                  topk_weights=torch.empty(3, K),
                                  topk_ids=torch.empty(3, K, dtype=torch.int32),
                                  moe_workspace=torch.empty(0))
    return mlp, views


def test_an_fp8_moe_layer_runs_its_offload_hook(experts, monkeypatch):
    """MoEMLP keeps FP8 experts in `scaled`; with the cache's hook attached, its routed experts
    go through the cache (never the resident experts), with the resident output."""
    from freetoken.engine.offload_setup import _LayerHook

    mlp, views = fp8_moe_layer(experts, monkeypatch)
    assert mlp.scaled is not None and mlp.w13 is None and mlp.decode is None
    x = (torch.randn(3, H, generator=torch.Generator().manual_seed(9)) * 0.5).to(torch.bfloat16)
    want = mlp(x, views).clone()
    cache = make_cache(experts, 4)
    cache.prefill = False
    mlp.offload = _LayerHook(cache, 0)

    def unused(*args):
        raise AssertionError("the resident FP8 experts ran beside an offload hook")

    mlp.scaled = unused
    assert torch.equal(mlp(x, views), want)
    assert cache.stats.misses > 0


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory):
    """A tiny qwen3_moe (8 experts, 2 per token, 2 layers) quantized to FP8 in 128x128 blocks.
    Whole blocks, none spanning a whole matrix (the reader takes one such as a per-tensor scale
    and widens it to a scale per row), so the memory plan's slot is the pool's, byte for byte."""
    from tests.models.helpers import tiny_hf_model
    from tests.models.scaled_checkpoint import write_scaled

    base = tmp_path_factory.mktemp("offload-fp8-cpu")
    (base / "float").mkdir()
    tiny_hf_model("qwen3_moe", base / "float", seed=3, hidden_size=256,
                  moe_intermediate_size=128, head_dim=32)
    directory, _ = write_scaled(base / "float", base / "fp8", "fp8-block")
    return directory


def build_fp8(directory, offloaded: bool):
    """The model as a GPU places it (its FP8 experts kept in their format; offloaded: in host
    tensors, as the plan hook asks), torch CPU tensors standing in for the GPU's."""
    from freetoken.arrays import TorchArrays, parse_device
    from freetoken.models import loader
    from freetoken.models.checkpoint.hf import read_hf_dir
    from freetoken.models.checkpoint.weights import Placement

    config, tensors, _, _ = read_hf_dir(directory)
    host = TorchArrays(parse_device("cpu")) if offloaded else None
    return loader._build_model(tensors, config,
                               Placement(TorchArrays(parse_device("cpu")), "float32", host))


def planned_slot(directory) -> int:
    """The memory plan's slot for the offloaded experts (checkpoint/footprint.py)."""
    from freetoken.models.checkpoint.footprint import weight_bytes
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.test_footprint import gpu_placement

    config, tensors, _, _ = read_hf_dir(directory)
    return weight_bytes(tensors, config, gpu_placement()).expert_slot


@pytest.mark.parametrize("rate", [0.5, 0.125])
def test_an_offloaded_fp8_model_gives_the_resident_logits(fp8_model_dir, monkeypatch, rate):
    """Load (the offloaded FP8 experts stay FP8 in host memory), attach (ScaledPool, every
    layer's hook) and run: prefill streams whole layers, decode goes through the slots, and
    every step's logits are the resident FP8 model's, bit for bit."""
    from freetoken.engine import offload_setup
    from freetoken.engine.offload_setup import OffloadDecision, attach_expert_cache
    from freetoken.kernel import ops
    from tests.models.helpers import PagedRunner

    monkeypatch.setattr(offload_setup, "pin", lambda t, total=0: t)
    for name in ("moe_experts_scaled", "moe_experts", "scaled_dequantize"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    resident_model, model = build_fp8(fp8_model_dir, False), build_fp8(fp8_model_dir, True)
    mlp = model.layers[0].mlp
    assert isinstance(mlp.scaled.weights[0], scaled.ScaledWeight) and mlp.w13 is None
    cache = attach_expert_cache(model, OffloadDecision(rate, 512, None, None, False))
    assert isinstance(cache.pool, ScaledPool) and cache.num_slots == max(2, int(rate * 16))
    assert cache.expert_bytes == planned_slot(fp8_model_dir)
    assert mlp.scaled is None and all(w.format == scaled.FP8 for w in cache.host_w13)
    ours, ref = (PagedRunner(m, num_blocks=32, block_size=16) for m in (model, resident_model))
    chunks = [(0, list(range(5, 25))), (1, list(range(40, 12, -1)))]
    a, b = ref.step(chunks), ours.step(chunks)
    for _ in range(6):
        assert torch.equal(torch.as_tensor(b), torch.as_tensor(a))
        nxt = [int(t) for t in torch.as_tensor(a).argmax(-1)]
        a = ref.step([(0, nxt[:1]), (1, nxt[1:])])
        b = ours.step([(0, nxt[:1]), (1, nxt[1:])])
    assert torch.equal(torch.as_tensor(b), torch.as_tensor(a))
    s = cache.stats.as_dict()
    assert s["expert_streamed_layers"] == 2 and s["expert_misses"] > 0
    cache.check_integrity()


# ---- NVFP4 experts ---------------------------------------------------------------------------

def nvfp4_stack(rows: int, cols: int, gen: torch.Generator) -> scaled.ScaledWeight:
    """Random experts [E, rows, cols] in NVFP4: e2m1 pairs, an e4m3 scale per 16 values and
    the expert's second-level scale as row scales (ModelOpt's layout, as the reader keeps it)."""
    from tests.models.scaled_checkpoint import quantize_nvfp4

    parts = [quantize_nvfp4(torch.randn(rows, cols, generator=gen) * 0.05) for _ in range(E)]
    packed, local = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    second = torch.stack([p[2].reshape(()).expand(rows) for p in parts]).contiguous()
    return scaled.ScaledWeight(scaled.NVFP4, packed, local, (E, rows, cols), (1, 16), second)


@pytest.fixture(scope="module")
def nvfp4_experts():
    gen = torch.Generator().manual_seed(1)
    w13, w2 = [], []
    for _ in range(LAYERS):
        w13.append(scaled.concat_rows([nvfp4_stack(I, H, gen) for _ in range(2)]))
        w2.append(nvfp4_stack(H, I, gen))
    return w13, w2


def test_nvfp4_slots_hold_the_packed_values_and_their_scales(nvfp4_experts):
    w13, w2 = nvfp4_experts
    cache = make_cache(nvfp4_experts, 5)
    values, scales13, rows13, values2, _, _ = cache.pool.parts
    assert cache.pool.format == scaled.NVFP4 and cache.in_format
    assert values.dtype == torch.uint8 and values.shape == (5 + 2 * E, 2 * I, H // 2)
    assert scales13.dtype == torch.float8_e4m3fn and scales13.shape[1:] == (2 * I, H // 16)
    assert values2.shape == (5 + 2 * E, H, I // 2)
    # a slot: half a byte a weight, a byte per 16 weights and a float32 row scale per row
    assert cache.expert_bytes == 3 * H * I // 2 + 3 * H * I // 16 + 4 * (2 * I + H)
    cache.prefill = False
    step(cache, nvfp4_experts, 1, 0)
    assert cache.stats.bytes_h2d == cache.stats.misses * (host_expert_bytes(w13[0]) +
                                                          host_expert_bytes(w2[0]))


@pytest.mark.parametrize("slots", [K, 5, E * LAYERS])
def test_nvfp4_decode_streaming_and_segments_give_the_resident_output(nvfp4_experts, slots):
    cache = make_cache(nvfp4_experts, slots)
    cache.prefill = False
    for seed in range(4):
        step(cache, nvfp4_experts, 1 + seed % 3, seed)     # batch 3 over K slots: staging
    cache.prefill = True
    step(cache, nvfp4_experts, GEMV_MAX_TOKENS + 3, 9)    # wide: the staged slots dequantized
    cache.prefill = False
    cache.segment_hook = cache.prepare_segment
    step(cache, nvfp4_experts, 2, 10)
    assert cache.stats.misses > 0 and cache.stats.streamed_layers == LAYERS


def test_the_pool_takes_one_format_and_no_cpu_kernel_for_nvfp4(experts, nvfp4_experts):
    from freetoken.kernel import ops

    assert ScaledPool.takes(*nvfp4_experts)
    assert not ScaledPool.takes(nvfp4_experts[0], experts[1])         # FP8 down, NVFP4 gate/up
    with pytest.raises(ValueError, match="FP8 experts only"):
        ScaledPool(*nvfp4_experts, K, KERNELS, ops.bind("moe_experts_scaled", "cpu"))


def test_driver_copy_spans_move_the_bytes_torch_copies_move(experts, nvfp4_experts):
    """Every part the host holds (values, scale grids, row scales where there are any)."""
    from tests.engine.driver_spans import assert_spans_copy_as_torch

    for w13, w2 in (experts, nvfp4_experts):
        assert_spans_copy_as_torch(lambda: ScaledPool(w13, w2, K, KERNELS), 3,
                                   [(0, 1, 0), (LAYERS - 1, E - 1, 2), (0, 2, 3 + E)])
