"""TP=2 (two processes, gloo) against TP=1 on the same tiny random checkpoints: the logits of
prefill and decode steps agree to float32 rounding, and the engine's greedy tokens are the
same; a live KV resize reaches every rank."""

from __future__ import annotations

import asyncio

import pytest

from tests.models.helpers import PagedRunner, assert_logits_close, tiny_hf_model
from tests.models.tiny_gguf import write_gguf

PROMPT = [5, 17, 33, 8, 99, 120, 7, 64, 3, 250]
CASES = {
    "qwen3": ("qwen3", {}),                              # 4 heads, 2 KV heads: one per rank
    "llama-one-kv-head": ("llama", {"num_key_value_heads": 1}),   # the KV head replicated
    "qwen3_moe": ("qwen3_moe", {}),                      # every expert's width split
}


@pytest.fixture(scope="module", params=list(CASES) + ["qwen3-gguf-q8_0"])
def models(request, tmp_path_factory):
    """(TP=1 model, TP=2 model) of one checkpoint; the TP=2 workers stop afterwards."""
    from freetoken.models.loader import load_model
    from freetoken.parallel.options import ParallelConfig
    from freetoken.parallel.start import start_sharded

    folder = tmp_path_factory.mktemp(request.param)
    if request.param.endswith("gguf-q8_0"):
        hf = tiny_hf_model("qwen3", folder, seed=5)
        path = folder / "tiny.gguf"
        write_gguf(hf, folder, path, "qwen3", 8)
    else:
        arch, overrides = CASES[request.param]
        tiny_hf_model(arch, folder, seed=5, **overrides)
        path = folder
    one = load_model(str(path), device="cpu")
    two = start_sharded(str(path), "auto", ParallelConfig(2, ("cpu", "cpu")), preload=False)
    yield one, two
    two.model.close()


def test_logits_match_tp1(models, moe_ops):
    one, two = models
    runners = [PagedRunner(m.model, seed=1) for m in (one, two)]
    steps = [[(0, PROMPT), (1, PROMPT[:4])], [(0, [42]), (1, [7])], [(0, [9]), (1, [250])]]
    for step in steps:
        expected, ours = (r.step(step) for r in runners)
        assert ours.shape == expected.shape == (2, one.config.vocab_size)
        assert_logits_close(ours, expected, one.model.config, msg=f"step {step}")


async def _greedy(engine, count: int = 16) -> list[int]:
    from freetoken.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
    return [t async for out in engine.generate(PROMPT, params) for t in out.token_ids]


def test_greedy_tokens_match_tp1_and_survive_a_kv_resize(models, moe_ops):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine

    config = EngineConfig(device="cpu", num_tokens=512, max_num_seqs=4,
                          max_prefill_tokens=64, overlap=False)
    one, two = models
    expected = asyncio.run(_greedy(Engine.from_loaded(one, config).start()))
    engine = Engine.from_loaded(two, config).start()
    try:
        assert asyncio.run(_greedy(engine)) == expected
        stats = engine.resize_pools(kv_tokens=256)
        assert stats["kv_pool_tokens"] == 256
        assert asyncio.run(_greedy(engine)) == expected
        ranks = engine.stats()["ranks"]
        assert engine.stats()["tensor_parallel_size"] == 2 and len(ranks) == 2
        assert ranks[0]["kv_pool_bytes"] == ranks[1]["kv_pool_bytes"] > 0
        assert ranks[0]["weight_bytes"] > 0
    finally:
        engine.shutdown()
