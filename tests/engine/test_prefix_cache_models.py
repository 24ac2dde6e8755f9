"""Prefix caching over the real model code: with the cache on, greedy outputs equal
transformers' on the same weights and the cache-off engine's, for concurrent requests sharing a
prefix, edited histories, repeats, chunked prefill that splits cached pages, and eviction."""

import asyncio

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.tiny_llama import write_tiny_llama

NEW_TOKENS = 8
# bf16 keeps 8 significant bits: logits up to ~32 in magnitude round in steps of 2**-8 * 32 =
# 0.125, and two differently chunked computations may each be a step off.
NEAR_TIE = 0.25
SYSTEM = "System: you are a coding agent. Tools: grep, read, write, test. " * 3


def agent_prompts(tokenizer) -> list[list[int]]:
    """Turns sharing a system prompt, one history with a rewritten middle, and repeats."""
    base = [tokenizer.encode(SYSTEM + f"User {i}: the quick brown fox jumps over the lazy dog.")
            for i in range(5)]
    edited = list(base[0])
    edited[len(edited) // 2] = (edited[len(edited) // 2] + 1) % 200   # a rewritten middle token
    return base + [edited] + base[:2]


def run_all(engine, prompts, concurrent: bool):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)

    async def one(prompt):
        outs = [out async for out in engine.generate(prompt, params)]
        return outs

    async def main():
        if concurrent:
            return await asyncio.gather(*(one(p) for p in prompts))
        return [await one(p) for p in prompts]

    return asyncio.run(main())


def tokens_of(outs) -> list[int]:
    return [t for out in outs for t in out.token_ids]


def hf_greedy(model, prompts) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def assert_released(engine):
    engine.pool.check_integrity([])
    assert sum(engine.pool._refs) == 0, f"{sum(engine.pool._refs)} page references left"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-prefix")
    write_tiny_llama(directory)
    return directory


def test_cpu_prefix_cache_matches_transformers_and_the_cache_off_engine(model_dir):
    from freetoken.models.loader import load_model
    from transformers import LlamaForCausalLM

    loaded = load_model(str(model_dir), device="cpu")
    prompts = agent_prompts(loaded.tokenizer)
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_greedy(hf, prompts)
    results = {}
    for cache in (True, False):
        # 20 pages of 16 cannot hold the 8 prompts at once (preemption, eviction); 24-token
        # chunks end mid-page, so later requests start inside a half-prefilled prefix.
        config = EngineConfig(num_tokens=320, block_size=16, max_num_seqs=4,
                              max_prefill_tokens=24, device="cpu", prefix_cache=cache)
        engine = Engine.from_loaded(loaded, config).start()
        try:
            first = run_all(engine, prompts, concurrent=True)
            again = run_all(engine, prompts, concurrent=False)
            stats = engine.stats()
            assert_released(engine)
        finally:
            engine.shutdown()
        results[cache] = ([tokens_of(o) for o in first], [tokens_of(o) for o in again], stats,
                          [o[-1].usage.cached_tokens for o in again])
    (first, again, stats, cached), (first_off, again_off, stats_off, cached_off) = (
        results[True], results[False])
    assert first == again == expected
    assert first_off == again_off == expected
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["prefix_cache_evictions"] > 0
    assert stats_off["prefix_cache_hit_tokens"] == 0 and cached_off == [0] * len(prompts)
    # Run one at a time, each turn finds at least the shared system prompt's full pages.
    shared = next(i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1)
    assert shared >= 32 and min(cached) >= shared // 16 * 16


def gpu_model(directory, dtype: str):
    """A tiny llama the CUDA attention kernel takes (head_dim 64), loaded on the GPU."""
    from freetoken.models.loader import load_model
    from tests.models.helpers import tiny_hf_model

    hf = tiny_hf_model("llama", directory, head_dim=64, num_attention_heads=2,
                       num_key_value_heads=1, hidden_size=128, max_position_embeddings=512)
    return hf, load_model(str(directory), device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_float32_prefix_cache_matches_transformers(tmp_path):
    """float32 on the GPU (CUDA graphs for decode): exact greedy parity with transformers."""
    hf, loaded = gpu_model(tmp_path, "float32")
    prompts = agent_prompts(loaded.tokenizer)
    expected = hf_greedy(hf, prompts)
    config = EngineConfig(num_tokens=320, block_size=16, max_num_seqs=4,
                          max_prefill_tokens=24, device="cuda")
    engine = Engine.from_loaded(loaded, config).start()
    try:
        first = run_all(engine, prompts, concurrent=True)
        again = run_all(engine, prompts, concurrent=False)
        stats = engine.stats()
        assert_released(engine)
    finally:
        engine.shutdown()
    assert [tokens_of(o) for o in first] == expected
    assert [tokens_of(o) for o in again] == expected
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["prefix_cache_evictions"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_prefix_cache_matches_the_cache_off_engine(tmp_path):
    """bf16 with CUDA graphs: cached KV was computed in another chunking, so the outputs may
    part only where the cache-off run's top-2 logprob gap is below NEAR_TIE (a near tie may
    fall either way); up to there they must agree token for token."""
    _, loaded = gpu_model(tmp_path, "bfloat16")
    prompts = agent_prompts(loaded.tokenizer)
    runs = {}
    for cache in (True, False):
        config = EngineConfig(num_tokens=320, block_size=16, max_num_seqs=4,
                              max_prefill_tokens=24, device="cuda", prefix_cache=cache)
        engine = Engine.from_loaded(loaded, config).start()
        try:
            runs[cache] = (run_all(engine, prompts, True) + run_all(engine, prompts, False),
                           engine.stats())
            assert_released(engine)
        finally:
            engine.shutdown()
    (with_cache, stats), (without, _) = runs[True], runs[False]
    assert stats["prefix_cache_hit_tokens"] > 0
    clear = 0
    for outs_on, outs_off in zip(with_cache, without):
        entries_off = [e for out in outs_off for e in out.logprobs]
        for token, entry in zip(tokens_of(outs_on), entries_off):
            near_tie = entry.top[0][1] - entry.top[1][1] < NEAR_TIE
            if token != entry.token_id:
                assert near_tie, f"with the cache {token}, without {entry.token_id} (clear margin)"
                break   # past a divergence the two contexts differ
            clear += not near_tie
    assert clear >= len(with_cache), f"only {clear} tokens had clear margins"
