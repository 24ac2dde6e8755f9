"""TP=2 on two GPUs (NCCL): greedy tokens equal TP=1's on the same float32 weights, with the
decode steps replayed from CUDA graphs that hold the all-reduces, on tiny dense and MoE models;
a live KV resize recaptures every rank's graphs. Skipped without two GPUs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.models.helpers import PagedRunner, assert_logits_close, tiny_hf_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]

# head_dim 64: a size the CUDA attention kernel takes (64, 128 or 256)
SHAPE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=512)
PROMPTS = [[5, 17, 33, 8, 99, 120, 7, 64, 3, 250], [11, 12, 13], [200, 3, 9, 41, 77]]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def models(request, tmp_path_factory):
    from freetoken.models.loader import load_model
    from freetoken.parallel.options import ParallelConfig
    from freetoken.parallel.start import start_sharded

    folder = tmp_path_factory.mktemp(f"tp-gpu-{request.param}")
    shape = {k: v for k, v in SHAPE.items()
             if request.param == "qwen3_moe" or k != "moe_intermediate_size"}
    tiny_hf_model(request.param, folder, seed=5, **shape)
    one = load_model(str(folder), device="cuda:0", dtype="float32")
    two = start_sharded(str(folder), "float32", ParallelConfig(2, ("cuda:0", "cuda:1")))
    yield one, two
    two.model.close()


def test_logits_match_tp1(models):
    one, two = models
    runners = [PagedRunner(m.model, seed=1) for m in (one, two)]
    for step in ([(0, PROMPTS[0]), (1, PROMPTS[1])], [(0, [42]), (1, [7])]):
        expected, ours = (r.step(step).float().cpu() for r in runners)
        assert_logits_close(ours, expected, one.model.config, msg=f"step {step}")


def _greedy(engine) -> list[list[int]]:
    from freetoken.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    async def one(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def every():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    return asyncio.run(every())


def test_graphed_greedy_tokens_match_tp1(models):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine

    one, two = models
    config = EngineConfig(device="cuda:0", num_tokens=1024, max_num_seqs=4,
                          max_prefill_tokens=64, overlap=False, kv_dtype="float32")
    reference = Engine.from_loaded(one, config).start()
    try:
        expected = _greedy(reference)
    finally:
        reference.shutdown()
    engine = Engine.from_loaded(two, config).start()
    try:
        assert engine.graphs is not None
        assert _greedy(engine) == expected
        engine.resize_pools(kv_tokens=512)          # every rank: a new pool, new graphs
        assert _greedy(engine) == expected
        ranks = engine.stats()["ranks"]
        assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"]
    finally:
        engine.shutdown()
