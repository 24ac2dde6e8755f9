"""A hybrid (Gated DeltaNet) model served by the engine: concurrent requests of different
lengths each hold a recurrent-state slot while running, their greedy outputs equal
transformers' generate on the same weights (float64 reference), and every slot is released."""

import asyncio

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from freetoken.models.loader import load_model
from tests.models.test_hybrid_hf import build_hybrid, float64_reference

NEW_TOKENS = 6


def hf_greedy(model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def run_all(engine, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def one(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_hybrid_engine_matches_transformers(prefix_cache, tmp_path, moe_ops):
    hf = build_hybrid("qwen3_5_moe", tmp_path)
    loaded = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 23, 12)]
    # small prefill budget: prompts run in several chunks, beside other sequences' decodes
    config = EngineConfig(num_tokens=256, block_size=8, max_num_seqs=4, max_prefill_tokens=16,
                          prefix_cache=prefix_cache)
    engine = Engine.from_loaded(loaded, config).start()
    try:
        assert engine.stats()["state_slots_total"] == 4
        got = run_all(engine, prompts + prompts[:1])
        stats = engine.stats()
    finally:
        engine.shutdown()
    expected = hf_greedy(float64_reference(hf), prompts + prompts[:1])
    assert got == expected
    assert stats["state_slots_used"] == 0
    assert stats["state_bytes_per_slot"] == 3 * loaded.config.linear.state_bytes(4)


def test_state_pool_shows_in_metrics():
    from freetoken.engine.engine import model_stats
    from freetoken.models.config import ModelConfig
    from freetoken.server.metrics import Metrics

    config = ModelConfig("llama", 10, 8, 16, 1, 2, 2, 4, 1e-6, 1e4, 32)
    stats = {"kv_occupancy": 0.0, "running": 1, "waiting": 0, **model_stats(config),
             "state_slots_used": 1, "state_slots_total": 4, "state_bytes_total": 4096}
    text = Metrics(lambda: stats).render()[0].decode()
    assert "freetoken_state_slots_total 4.0" in text
    assert "freetoken_state_bytes_total 4096.0" in text
