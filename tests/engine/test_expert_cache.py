"""The expert cache on the CPU: torch CPU tensors stand in for the GPU pool. Every step's output
is checked against kernel/reference.py's moe_experts over the full stacked experts (identity
map), whatever the slots, the evictions, the staging and the CPU co-execution did."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.expert_cache import ExpertCache
from freetoken.engine.expert_pool import FloatPool
from freetoken.engine.expert_slots import SlotLRU
from freetoken.engine.offload_policy import CoExecPolicy, Throughput, cpu_experts
from freetoken.kernel import reference
from tests.engine.driver_spans import MemmoveDriver, assert_spans_copy_as_torch

E, H, I, K, LAYERS = 8, 32, 16, 2, 3


def slot_kernel(out, x, w13, w2, ids, weights, emap, workspace):
    """moe_experts as the GPU contract states it: a pair whose slot is -1 contributes nothing."""
    acc = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            s = int(emap[int(ids[t, k])])
            if s < 0:
                continue
            gu = w13[s].double() @ x[t].double()
            act = torch.nn.functional.silu(gu[:I]) * gu[I:]
            acc[t] += float(weights[t, k]) * (w2[s].double() @ act)
    out.copy_(acc.to(out.dtype))


@pytest.fixture
def experts():
    g = torch.Generator().manual_seed(0)
    w13 = [torch.randn(E, 2 * I, H, generator=g) * 0.2 for _ in range(LAYERS)]
    w2 = [torch.randn(E, H, I, generator=g) * 0.2 for _ in range(LAYERS)]
    return w13, w2


def routing(tokens: int, seed: int, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    if skew:   # most tokens on experts 0..2
        probs = torch.tensor([8.0, 6, 4, 1, 1, 1, 1, 1])
        ids = torch.stack([torch.multinomial(probs, K, generator=g) for _ in range(tokens)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    return ids.to(torch.int32), w / w.sum(1, keepdim=True)


def expected(w13, w2, x, ids, weights):
    out = torch.empty_like(x)
    reference.moe_experts(out, x, w13, w2, ids, weights, torch.arange(E, dtype=torch.int32),
                          None)
    return out


def run_steps(cache, w13, w2, steps, tokens, skew=False):
    for step in range(steps):
        for layer in range(LAYERS):
            x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(100 * step + layer))
            ids, weights = routing(tokens, 1000 * step + layer, skew)
            out = torch.full_like(x, float("nan"))
            cache.run(layer, out, x, ids, weights, torch.empty(0, dtype=torch.uint8))
            want = expected(w13[layer], w2[layer], x, ids, weights)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        cache.check_integrity()


@pytest.mark.parametrize("slots", [2, 5, 12, 24])
def test_decode_through_the_lru_matches_the_resident_experts(experts, slots):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", slots)
    run_steps(cache, w13, w2, steps=6, tokens=1)
    s = cache.stats
    assert s.hits + s.misses == 6 * LAYERS * K          # batch 1: K distinct experts a layer
    assert s.bytes_h2d == s.misses * cache.expert_bytes
    if slots >= E * LAYERS:
        assert s.misses <= E * LAYERS                   # everything fits: each misses once


def test_a_cache_that_holds_everything_stops_missing(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", E * LAYERS)
    run_steps(cache, w13, w2, steps=8, tokens=3)
    misses = cache.stats.misses
    run_steps(cache, w13, w2, steps=4, tokens=3)
    assert cache.stats.misses == misses <= E * LAYERS


def test_misses_beyond_the_free_slots_go_through_staging(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", K)   # one layer's top-k only
    run_steps(cache, w13, w2, steps=3, tokens=3)          # 3 tokens route to up to 6 experts


def test_prefill_streams_whole_layers_without_touching_the_lru(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 4)
    run_steps(cache, w13, w2, steps=2, tokens=E)          # T * K >= E: streamed
    assert len(cache.lru) == 0 and cache.stats.hits + cache.stats.misses == 0
    assert cache.stats.streamed_layers == 2 * LAYERS


@pytest.mark.parametrize("skew", [False, True])
def test_co_execution_on_the_cpu_gives_the_same_outputs(experts, skew):
    w13, w2 = experts
    slow_pcie = Throughput(h2d_bytes_per_s=1e6, cpu_bytes_per_s=1e9, cpu_flops=1e9)
    policy = CoExecPolicy(slow_pcie, expert_bytes=3 * H * I * 4, flops_per_token=6 * H * I)
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 6, policy)
    run_steps(cache, w13, w2, steps=4, tokens=2, skew=skew)
    assert cache.stats.cpu_experts > 0


def test_cpu_experts_matches_the_reference(experts):
    w13, w2 = experts
    x = torch.randn(5, H)
    ids, weights = routing(5, 7)
    torch.testing.assert_close(cpu_experts(x, w13[0], w2[0], ids, weights, list(range(E))),
                               expected(w13[0], w2[0], x, ids, weights), rtol=1e-5, atol=1e-5)


def test_resize_keeps_what_still_fits_and_serves_on(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 16)
    run_steps(cache, w13, w2, steps=3, tokens=2)
    cache.resize(5)
    assert len(cache.lru) <= 5 and cache.pool.w13.shape[0] == 5 + 2 * E
    run_steps(cache, w13, w2, steps=3, tokens=2)
    cache.resize(30)
    run_steps(cache, w13, w2, steps=3, tokens=2)


def test_lru_evicts_the_least_recent_key_not_held():
    lru = SlotLRU(3)
    placed = lru.place([(0, 1), (0, 2), (0, 3)], keep=())
    assert [s for _, s, _ in placed] == [0, 1, 2]
    lru.lookup((0, 1))                                  # (0, 2) is now the oldest
    (key, slot, evicted), = lru.place([(1, 0)], keep=[(0, 2)])
    assert evicted == (0, 3) and slot == 2 and (0, 2) in lru
    assert not lru.can_place(3, keep=[(0, 1), (0, 2), (1, 0)])
    with pytest.raises(ValueError, match="do not fit"):
        lru.place([(2, 0)], keep=[(0, 1), (0, 2), (1, 0)])
    assert lru.resize(2) == [(1, 0)] and len(lru) == 2
    lru.check_integrity()
    with pytest.raises(ValueError, match="at least one slot"):
        SlotLRU(0)


def test_the_engine_hint_decides_between_streaming_and_the_lru(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 24)
    cache.prefill = False
    run_steps(cache, w13, w2, steps=2, tokens=E)           # a big decode batch: the LRU
    assert cache.stats.streamed_layers == 0 and cache.stats.misses > 0
    cache.prefill = True
    run_steps(cache, w13, w2, steps=1, tokens=1)           # a one-token prompt chunk: streams
    assert cache.stats.streamed_layers == LAYERS


class CountingMap:
    """Stands in for a layer's device map: counts uploads, indexes like the tensor."""

    def __init__(self, tensor):
        self.tensor, self.uploads = tensor, 0

    def copy_(self, src, non_blocking=False):
        self.uploads += 1
        self.tensor.copy_(src)

    def __getitem__(self, index):
        return self.tensor[index]


def run_segments(cache, w13, w2, steps, tokens, real, seed=0):
    """Decode steps as the graph segments run them: the experts kernel reads the map that
    prepare_segment made from the first `real` rows' ids (the rest are padding)."""
    cache.segment_hook = lambda layer, ids: cache.prepare_segment(layer, ids[:real])
    for step in range(steps):
        for layer in range(LAYERS):
            g = torch.Generator().manual_seed(100 * (seed + step) + layer)
            x = torch.randn(tokens, H, generator=g)
            ids, weights = routing(tokens, 1000 * (seed + step) + layer)
            out = torch.full_like(x, float("nan"))
            cache.run(layer, out, x, ids, weights, torch.empty(0, dtype=torch.uint8))
            want = expected(w13[layer], w2[layer], x[:real], ids[:real], weights[:real])
            torch.testing.assert_close(out[:real], want, rtol=1e-5, atol=1e-5)
        cache.check_integrity()


@pytest.mark.parametrize("slots", [2, 5, 24])
@pytest.mark.parametrize("tokens,real", [(1, 1), (4, 3), (4, 4)])
def test_graph_segments_route_the_real_rows_through_the_lru(experts, slots, tokens, real):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", slots)
    cache.prefill = False
    run_segments(cache, w13, w2, steps=5, tokens=tokens, real=real)
    s = cache.stats
    assert s.tokens == 5 * real and s.cpu_experts == 0
    assert s.hits + s.misses == sum(
        len(set(routing(tokens, 1000 * step + layer)[0][:real].flatten().tolist()))
        for step in range(5) for layer in range(LAYERS))


def test_graph_segments_upload_a_map_only_when_a_routed_slot_changed(experts):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", E * LAYERS)
    cache.prefill = False
    cache.maps_dev = [CountingMap(m) for m in cache.maps_dev]
    run_segments(cache, w13, w2, steps=1, tokens=2, real=2)
    assert [m.uploads for m in cache.maps_dev] == [1] * LAYERS      # every expert missed
    run_segments(cache, w13, w2, steps=1, tokens=2, real=2)          # the same routing again
    assert [m.uploads for m in cache.maps_dev] == [1] * LAYERS
    assert cache.stats.hits == cache.stats.misses
    run_segments(cache, w13, w2, steps=1, tokens=2, real=2, seed=1)  # new experts: uploads
    assert all(m.uploads == 2 for m in cache.maps_dev)


def test_graph_segments_never_hand_misses_to_the_cpu(experts):
    w13, w2 = experts
    slow_pcie = Throughput(h2d_bytes_per_s=1e6, cpu_bytes_per_s=1e9, cpu_flops=1e9)
    policy = CoExecPolicy(slow_pcie, expert_bytes=3 * H * I * 4, flops_per_token=6 * H * I)
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 6, policy)
    cache.prefill = False
    run_segments(cache, w13, w2, steps=3, tokens=2, real=2)
    assert cache.stats.cpu_experts == 0 and cache.stats.misses > 0


def test_a_layer_lookup_touches_its_hits_like_single_lookups():
    lru = SlotLRU(4)
    lru.place([(0, 1), (0, 2), (1, 1), (0, 3)], keep=())
    hits, misses = lru.lookup_layer(0, [3, 5, 1])
    assert hits == {3: 3, 1: 0} and misses == [5]
    (_, _, evicted), = lru.place([(2, 0)], keep=())
    assert evicted == (0, 2)                 # (0, 1) and (0, 3) were touched, (1, 1) is newer


def test_segments_and_misses_run_in_and_out_of_inference_mode(experts):
    """Graph segments are captured (and the engine may resize) in inference mode while a caller
    may replay outside it: the buffers the cache writes in place must accept either mode (the
    H200 run failed with 'Inplace update to inference tensor outside InferenceMode')."""
    w13, w2 = experts
    with torch.inference_mode():
        cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 5)
        cache.prefill = False
        run_segments(cache, w13, w2, steps=2, tokens=2, real=2)     # pinned id views made here
        cache.resize(4)                                             # a new pool made here
    run_segments(cache, w13, w2, steps=3, tokens=2, real=2, seed=2)
    run_steps(cache, w13, w2, steps=2, tokens=2)
    with torch.inference_mode():
        run_segments(cache, w13, w2, steps=2, tokens=2, real=1, seed=5)
    assert cache.stats.misses > 0


class RoutingPredictor:
    """predictors[layer](x) for run_steps/run_segments: the ids the next layer will route to
    (`right`), or other experts (not `right`), read from the step's seeds."""

    def __init__(self, tokens: int, right: bool):
        self.tokens, self.right, self.step = tokens, right, 0

    def for_layer(self, layer: int):
        def predict(x):
            ids, _ = routing(self.tokens, 1000 * self.step + layer + 1)
            if layer + 1 == LAYERS - 1:
                self.step += 1
            return ids if self.right else (ids + 3) % E
        return predict


def predicted_cache(experts, slots, tokens, right):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", slots)
    cache.prefill = False
    predictor = RoutingPredictor(tokens, right)
    cache.predictors = [predictor.for_layer(l) for l in range(LAYERS - 1)] + [None]
    return cache


@pytest.mark.parametrize("slots", [3, 6, 24])
@pytest.mark.parametrize("right", [True, False])
def test_prefetched_experts_leave_every_output_exact(experts, slots, right):
    """Prefetching the next layer's experts never evicts what the current layer is about to
    read: on the CPU every copy lands before the kernel runs, so a wrong eviction would show
    as a wrong output."""
    w13, w2 = experts
    cache = predicted_cache(experts, slots, tokens=1, right=right)
    run_steps(cache, w13, w2, steps=6, tokens=1)
    s = cache.stats
    assert s.prefetch_hits <= s.prefetched
    if slots >= 2 * K:
        assert s.prefetched > 0
    if right and slots >= 2 * K:
        # every prediction was right: what was copied ahead was routed, and those layers missed
        # nothing (a layer's experts always fit beside the previous layer's)
        assert s.prefetch_hits == s.prefetched
    assert s.bytes_h2d == (s.misses + s.prefetched) * cache.expert_bytes


def test_right_predictions_turn_the_next_layers_misses_into_hits(experts):
    w13, w2 = experts
    plain = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 6)
    plain.prefill = False
    run_steps(plain, w13, w2, steps=6, tokens=1)
    ahead = predicted_cache(experts, 6, tokens=1, right=True)
    run_steps(ahead, w13, w2, steps=6, tokens=1)
    assert ahead.stats.misses < plain.stats.misses
    assert ahead.stats.hits + ahead.stats.misses == plain.stats.hits + plain.stats.misses


@pytest.mark.parametrize("right", [True, False])
def test_graph_segments_prefetch_from_the_ids_they_read(experts, right):
    """Segments read [routed | predicted] ids in one buffer: the routed half is looked up, the
    predicted half copied ahead for the next layer."""
    w13, w2 = experts
    cache = predicted_cache(experts, 6, tokens=2, right=right)
    cache.segment_hook = lambda layer, ids: cache.prepare_segment(layer, ids[:2])
    for step in range(4):
        for layer in range(LAYERS):
            x = torch.randn(2, H, generator=torch.Generator().manual_seed(100 * step + layer))
            ids, weights = routing(2, 1000 * step + layer)
            out = torch.full_like(x, float("nan"))
            cache.run(layer, out, x, ids, weights, torch.empty(0, dtype=torch.uint8))
            torch.testing.assert_close(out, expected(w13[layer], w2[layer], x, ids, weights),
                                       rtol=1e-5, atol=1e-5)
        cache.check_integrity()
    s = cache.stats
    assert s.tokens == 4 * 2 and s.prefetched > 0
    assert (s.prefetch_hits == s.prefetched) if right else (s.prefetch_hits < s.prefetched)


def test_driver_copy_spans_move_the_bytes_torch_copies_move(experts):
    w13, w2 = experts
    assert_spans_copy_as_torch(lambda: FloatPool(w13, w2, slot_kernel), 5,
                               [(0, 3, 0), (2, 7, 4), (1, 0, 5 + E), (2, 1, 0)])


@pytest.mark.parametrize("segments", [False, True], ids=["eager", "graph-segments"])
def test_steps_through_driver_copies_match_the_resident_experts(experts, segments):
    """The cache's driver path (spans per miss and prefetch, map uploads) on the CPU."""
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 5)
    cache._driver = driver = MemmoveDriver()
    if segments:
        cache.prefill = False
        run_segments(cache, w13, w2, steps=4, tokens=3, real=3)
    else:
        run_steps(cache, w13, w2, steps=4, tokens=3)
    assert driver.copies == cache.stats.misses > 0 and driver.uploads > 0


def test_a_refused_driver_copy_falls_back_to_torch_copies(experts, caplog):
    w13, w2 = experts
    cache = ExpertCache(FloatPool(w13, w2, slot_kernel), "cpu", 5)
    cache._driver = MemmoveDriver(fail=True)
    with caplog.at_level("WARNING"):
        run_steps(cache, w13, w2, steps=2, tokens=3)
    assert cache._driver is None and cache.stats.misses > 0
    assert "go back to torch's copy_" in caplog.text and "CUresult 201" in caplog.text
