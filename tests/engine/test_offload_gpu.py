"""Offloaded experts on a GPU against the resident model: cache rates 0.5, 0.1 and ~1, CPU
co-execution on and off, and pools resized while a request streams. Skipped without a GPU.

The model: a random qwen3_moe with 32 experts, 4 per token, 4 layers (128 experts in all), so
batch-1 decode goes through the LRU, batch-4 decode at rate 0.1 (12 slots) overflows into the
staging buffer, and the 40-token prefills stream whole layers. Its greedy margins are small
(random weights), and the dense kernels are not batch-invariant, so every comparison holds the
batch composition fixed: a paged runner that prefills the prompts in one step and decodes them
together, or the engine serving one request at a time, eagerly on both sides or with decode
graphs on both sides (segments around each MoE layer's routing when offloaded). A rate below 1
runs every expert through the resident kernel with a slot map, so its logits must be
bit-identical; CPU co-execution adds a float32 CPU partial sum in bf16, so each co-executed
layer's output may move by bf16 roundings, never by a missing or doubled expert (an O(1) change).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.tolerances import assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=512, num_experts=32,
             num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024)
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(40)] for i in range(4)]
NEW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("offload-qwen3_moe")
    tiny_hf_model("qwen3_moe", directory, seed=5, **SHAPE)
    return directory


def offloaded_model(model_dir, rate: float, cpu: bool = False, prefetch: bool = False):
    """(model with an expert cache attached, cache); cpu forces the co-execution policy to
    hand the CPU most misses, as if PCIe were slow; prefetch copies the next layer's predicted
    misses ahead (--moe-prefetch on)."""
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput
    from freetoken.engine.offload_setup import OffloadDecision, attach_expert_cache
    from freetoken.models.loader import load_model

    loaded = load_model(str(model_dir), device="cuda", plan=lambda cfg, dtype, weights: True)
    cache = attach_expert_cache(loaded.model, OffloadDecision(rate, 2048, None, None, False,
                                                              prefetch))
    if cpu:
        cache.policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14), cache.expert_bytes,
                                    6 * cache.hidden * cache.inter)
    return loaded, cache


class Graphed:
    """A model whose decode steps replay `graphs` (captured over the runner's KV pool)."""

    def __init__(self, model, graphs):
        self.model, self.graphs, self.arrays = model, graphs, model.arrays
        self.replays = 0

    def forward(self, batch, kv):
        if not self.graphs.can_run(batch):
            return self.model.forward(batch, kv)
        self.replays += 1
        return self.graphs.run(batch)


def run_fixed(model, prompts, cache=None, graphs=False):
    """Greedy tokens per prompt and the logits of every step, the prompts prefilled in one step
    and decoded together; with `graphs`, decode steps replay CUDA graphs (segments when the
    model's experts go through `cache`)."""
    from freetoken.engine.segment_graphs import capture_decode_graphs

    runner = PagedRunner(model, num_blocks=64, block_size=16)
    if graphs:
        captured = capture_decode_graphs(model, runner.kv, len(prompts), 8, cache)
        assert captured is not None, "capturing the decode graphs failed (see the log)"
        runner.model = Graphed(model, captured)
    logits = runner.step([(i, p) for i, p in enumerate(prompts)])
    tokens, steps = [[] for _ in prompts], []
    for _ in range(NEW):
        logits = logits.float().clone()
        steps.append(logits)
        nxt = logits.argmax(-1).tolist()
        for seq, t in zip(tokens, nxt):
            seq.append(t)
        logits = runner.step([(i, [t]) for i, t in enumerate(nxt)])
    if graphs:
        assert runner.model.replays == NEW
    return tokens, steps


def assert_resident_logits(model, cache, resident, graphs: bool) -> dict:
    """Batches 1 and 4 through `cache` give the resident run's tokens and logits bit for bit
    (eagerly, or in graph segments against the resident graphs); some lookups hit, some
    missed, and both prompt steps streamed their 4 layers. Returns the cache's stats."""
    for batch in (1, 4):
        tokens, steps = run_fixed(model, PROMPTS[:batch], cache, graphs)
        want_tokens, want_steps = resident[batch, graphs]
        assert tokens == want_tokens
        for i, (got, want) in enumerate(zip(steps, want_steps)):
            assert torch.equal(got, want), (batch, i, (got - want).abs().max())
    s = cache.stats.as_dict()
    assert s["expert_misses"] > 0 and s["expert_hits"] > 0 and s["expert_streamed_layers"] == 8
    return s


@pytest.fixture(scope="module")
def resident(model_dir):
    """(batch, graphs) -> the resident model's tokens and logits."""
    from freetoken.models.loader import load_model

    model = load_model(str(model_dir), device="cuda").model
    # Offloaded layers run moe_experts through the slot map; the resident one-token steps would
    # take the fused MoE decode kernels (another summation order): compare the same kernel.
    for layer in model.layers:
        if getattr(layer.mlp, "decode", None) is not None:
            layer.mlp.decode = None
    return {(b, g): run_fixed(model, PROMPTS[:b], graphs=g) for b in (1, 4) for g in (False, True)}


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
@pytest.mark.parametrize("rate", [0.5, 0.1, 0.999])
def test_offloaded_logits_are_bit_identical(model_dir, resident, rate, graphs, prefetch):
    """Eager against the resident eager forward; graph segments against the resident graphs.
    Prefetching moves only where experts sit and when they are copied, never a result."""
    loaded, cache = offloaded_model(model_dir, rate, prefetch=prefetch)
    assert cache.num_slots == int(rate * 128)
    s = assert_resident_logits(loaded.model, cache, resident, graphs)
    assert s["expert_cpu_executed"] == 0
    if prefetch and rate < 0.999:
        assert s["expert_prefetched"] > 0
    if not prefetch:
        assert s["expert_prefetched"] == 0
    cache.check_integrity()


def check_co_executed_layers(cache) -> list:
    """Wraps cache.run: every decode layer call that handed experts to the CPU is compared, on
    the same input and routing, with the resident experts kernel over the layer's full stacked
    experts (identity map). Returns the list of checked (layer, CPU experts) pairs.

    Per layer, not through the logits: the random model's router logits reach ~100, and a
    float32 CPU emulation (the same model, prompts and batch) showed that perturbing each decode
    MoE output by one bf16 rounding (uniform +-2^-9..2^-7 relative) moves the next steps'
    router logits by 2-20 % of their scale, so no rounding bound survives to the logits (the
    H200 run at c121885 failed such a bound at batch 4, step 2: 5.875 of 84.5). A layer's own
    output differs only by the CPU part's roundings: its gate/up, activation and down in bf16,
    and the two bf16 sums (<= 1 ulp of the row's largest value in the emulation), while a
    missing or doubled expert moves the row by its weighted output (the router's softmax at
    that scale gives the top expert nearly all the weight: most of the row)."""
    run, checked, full = cache.run, [], {}
    identity = torch.arange(cache.num_experts, dtype=torch.int32, device=cache.device)

    def checked_run(layer, out, x, topk_ids, topk_weights, workspace):
        before = cache.stats.cpu_experts
        run(layer, out, x, topk_ids, topk_weights, workspace)
        cpu = cache.stats.cpu_experts - before
        if cpu == 0:
            return
        if layer not in full:
            full[layer] = (cache.host_w13[layer].to(cache.device),
                           cache.host_w2[layer].to(cache.device))
        want = torch.empty_like(out)
        cache.kernel(want, x, *full[layer], topk_ids, topk_weights, identity, workspace)
        rows = want.float().abs().amax(1, keepdim=True)
        assert_close(out, want, "bfloat16", magnitude=rows.cpu(), msg=f"MoE layer {layer}")
        checked.append((layer, cpu))

    cache.run = checked_run
    return checked


@pytest.mark.parametrize("rate", [0.5, 0.1])
def test_co_execution_changes_each_layer_by_rounding_only(model_dir, resident, rate):
    """The CPU's float32 partial sums, added in bf16, change each co-executed MoE layer's
    output by roundings only; the prefill streams whole layers (no co-execution), so its
    logits are the resident ones bit for bit."""
    loaded, cache = offloaded_model(model_dir, rate, cpu=True)
    checked = check_co_executed_layers(cache)
    for batch in (1, 4):
        _, steps = run_fixed(loaded.model, PROMPTS[:batch])
        assert torch.equal(steps[0], resident[batch, False][1][0])
    assert cache.stats.cpu_experts > 0
    assert sum(cpu for _, cpu in checked) == cache.stats.cpu_experts
    assert {layer for layer, _ in checked} == set(range(cache.num_layers))


def make_engine(model_dir, rate: float, num_tokens: int = 2048, graphs: bool = False):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.models.loader import load_model

    config = EngineConfig(num_tokens=num_tokens, max_num_seqs=4, max_prefill_tokens=256,
                          device="cuda", cuda_graphs=graphs)
    if rate >= 1.0:
        return Engine.from_loaded(load_model(str(model_dir), device="cuda"), config).start()
    loaded = load_model(str(model_dir), device="cuda", plan=lambda cfg, dtype, weights: True)
    decision = OffloadDecision(rate, num_tokens, None, None, False)
    return Engine.from_loaded(loaded, config, decision).start()


def generate(engine, prompt, during=None):
    """Greedy tokens of one request; `during(i)` runs after the i-th streamed token."""
    from freetoken.engine.request import SamplingParams

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        out = []
        async for o in engine.generate(prompt, params):
            out.extend(o.token_ids)
            if during is not None:
                await asyncio.to_thread(during, len(out))
        return out

    return asyncio.run(run())


@pytest.fixture(scope="module")
def engine_reference(model_dir):
    """One request at a time through resident engines, eager and with decode graphs."""
    out = {}
    for graphs in (False, True):
        engine = make_engine(model_dir, 1.0, graphs=graphs)
        try:
            assert (engine.graphs is not None) == graphs
            out[graphs] = [generate(engine, p) for p in PROMPTS[:2]]
        finally:
            engine.shutdown()
    return out


def test_the_offloaded_engine_serves_the_resident_tokens(model_dir, engine_reference):
    engine = make_engine(model_dir, 0.1)
    try:
        assert engine.graphs is None and engine.expert_cache is not None
        assert [generate(engine, p) for p in PROMPTS[:2]] == engine_reference[False]
        stats = engine.stats()
        assert stats["moe_offload"] and stats["expert_misses"] > 0
        assert stats["pinned_bytes"] == 128 * 3 * 256 * 128 * 2
        assert stats["expert_streamed_layers"] == 2 * 4
    finally:
        engine.shutdown()


def count_replays(engine) -> list:
    """Appends to the returned list at every decode step the engine's graphs run."""
    calls, run = [], engine.graphs.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    engine.graphs.run = counted
    return calls


@pytest.mark.parametrize("rate", [0.999, 0.5, 0.1])
def test_the_offloaded_engine_decodes_in_graph_segments(model_dir, engine_reference, rate):
    """The resident graphs' tokens; and against the offloaded engine's eager decode: the same
    tokens exactly when the resident engine's graphs and eager steps agree."""
    from freetoken.engine.segment_graphs import SegmentedDecodeGraphs

    engine = make_engine(model_dir, rate, graphs=True)
    try:
        assert isinstance(engine.graphs, SegmentedDecodeGraphs)
        assert len(engine.graphs.segments[1]) == 4 + 1
        replays = count_replays(engine)
        got = [generate(engine, p) for p in PROMPTS[:2]]
        assert got == engine_reference[True]
        assert len(replays) == 2 * (NEW - 1)      # every decode step; prefill runs eagerly
        stats = engine.stats()
        assert stats["expert_misses"] > 0 and stats["expert_tokens"] == 2 * (40 + NEW - 1)
        engine.expert_cache.check_integrity()
    finally:
        engine.shutdown()
    eager = make_engine(model_dir, rate, graphs=False)
    try:
        eager_tokens = [generate(eager, p) for p in PROMPTS[:2]]
    finally:
        eager.shutdown()
    assert (got == eager_tokens) == (engine_reference[True] == engine_reference[False])


@pytest.mark.parametrize("rate,graphs", [(1.0, True), (0.5, False), (0.5, True)])
def test_resize_mid_stream_keeps_the_tokens(model_dir, engine_reference, rate, graphs):
    import time

    engine = make_engine(model_dir, rate, graphs=graphs)
    step = engine._step

    def slow_step(*work):
        time.sleep(0.05)      # NOTE: so every resize below lands while the request streams
        step(*work)

    engine._step = slow_step
    moe = rate < 1
    resizes = {2: dict(kv_tokens=4096), 5: dict(moe_rate=0.1 if moe else None),
               8: dict(kv_tokens=1024, wait=10.0), 11: dict(moe_rate=0.75 if moe else None)}
    running = []

    def resize(i):
        if i in resizes:
            stats = engine.resize_pools(**resizes[i])
            running.append(engine.stats()["running"])
            if resizes[i].get("kv_tokens"):
                assert stats["kv_pool_tokens"] == resizes[i]["kv_tokens"]

    try:
        assert generate(engine, PROMPTS[0], during=resize) == engine_reference[graphs][0]
        assert len(running) == 4 and min(running) == 1
        if moe:
            assert engine.expert_cache.num_slots == int(0.75 * 128)
        # recaptured over the new KV and expert pools
        assert (engine.graphs is not None) == graphs
    finally:
        engine.shutdown()


def test_a_resize_beyond_free_memory_is_refused_and_the_old_pools_serve(model_dir,
                                                                        engine_reference):
    from freetoken.engine.memory_plan import MemoryPlanError

    engine = make_engine(model_dir, 0.5)
    try:
        free, _ = torch.cuda.mem_get_info()
        kv_per_token = 2 * 4 * 2 * 64 * 2
        with pytest.raises(MemoryPlanError, match="does not fit"):
            engine.resize_pools(kv_tokens=2 * free // kv_per_token)
        assert engine.stats()["kv_pool_tokens"] == 2048
        assert generate(engine, PROMPTS[1]) == engine_reference[False][1]
    finally:
        engine.shutdown()


def assert_driver_copies_give_the_resident_logits(source, resident, graphs: bool,
                                                  monkeypatch) -> None:
    """FREETOKEN_DRIVER_COPIES=1: the misses' and prefetches' spans and the maps go through
    cuMemcpyHtoDAsync, and the logits stay the resident ones bit for bit; no copy is refused."""
    monkeypatch.setenv("FREETOKEN_DRIVER_COPIES", "1")
    loaded, cache = offloaded_model(source, 0.5, prefetch=True)
    assert cache._driver is not None and cache.pool.copy_spans(0) is not None
    assert_resident_logits(loaded.model, cache, resident, graphs)
    assert cache._driver is not None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
def test_driver_copies_give_the_resident_logits_bit_for_bit(model_dir, resident, graphs,
                                                             monkeypatch):
    assert_driver_copies_give_the_resident_logits(model_dir, resident, graphs, monkeypatch)
