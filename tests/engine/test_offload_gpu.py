"""Offloaded experts on a GPU give the resident model's greedy tokens: cache rates 1.0, 0.5 and
0.1, co-execution on and off, and pools resized while requests stream. Skipped without a GPU.

The model: a random qwen3_moe with 32 experts, 4 per token, 4 layers (128 experts in all), so
batch-1 decode goes through the LRU, batch-4 decode at rate 0.1 (12 slots) overflows into the
staging buffer, and the 40-token prefills stream whole layers. A rate below 1 runs every
expert through the same kernel with a slot map, so its tokens must match exactly; CPU
co-execution adds a float32 CPU partial sum in bf16, which moves logits by bf16 rounding only:
its tokens must match wherever the resident model's top-2 margin is not a near tie.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.models.helpers import tiny_hf_model

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


def make_engine(model_dir, rate: float, cpu: bool = False, num_tokens: int = 2048):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.models.loader import load_model

    config = EngineConfig(num_tokens=num_tokens, max_num_seqs=4, max_prefill_tokens=256,
                          device="cuda")
    if rate >= 1.0:
        return Engine.from_loaded(load_model(str(model_dir), device="cuda"), config).start()
    loaded = load_model(str(model_dir), device="cuda", plan=lambda cfg, dtype: True)
    decision = OffloadDecision(rate, num_tokens, None, None, cpu)
    engine = Engine.from_loaded(loaded, config, decision)
    if cpu:   # as if PCIe were slow: the policy then hands the CPU some of every step's misses
        from freetoken.engine.offload_policy import CoExecPolicy, Throughput

        old = engine.expert_cache.policy
        engine.expert_cache.policy = CoExecPolicy(Throughput(1e8, 1e12, 1e14),
                                                  old.expert_bytes, old.flops_per_token)
    return engine.start()


def generate(engine, prompts, during=None, margins=None):
    """Greedy tokens of each prompt; `margins` (a list) gets each one's top-1 - top-2
    log-probability margins."""
    from freetoken.engine.request import SamplingParams

    async def one(prompt, index):
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True,
                                logprobs=2 if margins is not None else None)
        out, gaps = [], []
        async for o in engine.generate(prompt, params):
            out.extend(o.token_ids)
            for entry in o.logprobs or ():
                (_, first), (_, second) = entry.top[:2]
                gaps.append(first - second)
            if during is not None and index == 0:
                await asyncio.to_thread(during, len(out))
        if margins is not None:
            margins.append(gaps)
        return out

    async def run():
        return await asyncio.gather(*(one(p, i) for i, p in enumerate(prompts)))

    return asyncio.run(run())


@pytest.fixture(scope="module")
def resident(model_dir):
    engine = make_engine(model_dir, 1.0)
    margins = []
    try:
        assert engine.graphs is not None and engine.expert_cache is None
        return {1: generate(engine, PROMPTS[:1]), 4: generate(engine, PROMPTS, margins=margins),
                "margins": margins}
    finally:
        engine.shutdown()


# CPU co-execution sums a float32 CPU partial into the bf16 output: logits move by a few bf16
# roundings (2^-8 relative) of logits of magnitude ~10, so a greedy choice may differ only
# where the resident top-2 margin is below this (after which the histories differ).
NEAR_TIE = 0.1


def assert_same_greedy(ours, resident, exact: bool):
    if exact:
        assert ours == resident[4]
        return
    for got, want, gaps in zip(ours, resident[4], resident["margins"]):
        for i, (a, b) in enumerate(zip(got, want)):
            if a != b:
                assert gaps[i] < NEAR_TIE, (i, got, want, gaps)
                break


@pytest.mark.parametrize("rate, cpu", [(0.5, False), (0.1, False), (0.5, True), (0.1, True)])
def test_offloaded_experts_give_the_resident_tokens(model_dir, resident, rate, cpu):
    engine = make_engine(model_dir, rate, cpu)
    try:
        assert engine.graphs is None and engine.expert_cache.num_slots == int(rate * 128)
        if not cpu:
            assert generate(engine, PROMPTS[:1]) == resident[1]
        assert_same_greedy(generate(engine, PROMPTS), resident, exact=not cpu)
        stats = engine.stats()
        assert stats["moe_offload"] and stats["expert_misses"] > 0
        assert stats["expert_hits"] > 0 and stats["expert_streamed_layers"] > 0
        assert stats["pinned_bytes"] == 128 * 3 * 256 * 128 * 2
        assert (stats["expert_cpu_executed"] > 0) == cpu
        engine.expert_cache.check_integrity()
    finally:
        engine.shutdown()


def test_rate_one_keeps_every_expert_hit_after_warm_up(model_dir, resident):
    engine = make_engine(model_dir, 0.999)     # offloaded mode, but 127 of 128 slots
    try:
        generate(engine, PROMPTS)
        misses = engine.stats()["expert_misses"]
        assert generate(engine, PROMPTS) == resident[4]
        assert engine.stats()["expert_misses"] - misses <= 4 * 4 * NEW
    finally:
        engine.shutdown()


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_resize_mid_stream_keeps_the_tokens(model_dir, resident, rate):
    import time

    engine = make_engine(model_dir, rate)
    step = engine._step

    def slow_step(*work):
        time.sleep(0.02)      # NOTE: so every resize below lands while the requests stream
        step(*work)

    engine._step = slow_step
    steps = {2: dict(kv_tokens=4096), 5: dict(moe_rate=0.1 if rate < 1 else None),
             8: dict(kv_tokens=1024, wait=10.0), 11: dict(moe_rate=0.75 if rate < 1 else None)}
    running = []

    def resize(i):
        if i in steps:
            stats = engine.resize_pools(**steps[i])
            running.append(engine.stats()["running"])
            if steps[i].get("kv_tokens"):
                assert stats["kv_pool_tokens"] == steps[i]["kv_tokens"]

    try:
        assert generate(engine, PROMPTS, during=resize) == resident[4]
        assert len(running) == 4 and min(running) >= 1
        if rate < 1:
            assert engine.expert_cache.num_slots == int(0.75 * 128)
        else:
            assert engine.graphs is not None      # recaptured over the new KV pool
    finally:
        engine.shutdown()


def test_a_resize_beyond_free_memory_is_refused_and_the_old_pools_serve(model_dir, resident):
    from freetoken.engine.memory_plan import MemoryPlanError

    engine = make_engine(model_dir, 0.5)
    try:
        free, _ = torch.cuda.mem_get_info()
        kv_per_token = 2 * 4 * 2 * 64 * 2
        with pytest.raises(MemoryPlanError, match="does not fit"):
            engine.resize_pools(kv_tokens=2 * free // kv_per_token)
        assert engine.stats()["kv_pool_tokens"] == 2048
        assert generate(engine, PROMPTS) == resident[4]
    finally:
        engine.shutdown()
