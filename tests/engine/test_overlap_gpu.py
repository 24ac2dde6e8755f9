"""Overlap scheduling on a GPU with CUDA graphs: greedy tokens equal transformers' on the same
float32 weights and the synchronous engine's, under continuous batching with requests arriving
and stopping mid-decode; seeded sampling is the same with overlap on and off. Skipped without a
GPU."""

import asyncio

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.test_prefix_cache_models import agent_prompts, assert_released, gpu_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = [24, 7, 31, 12, 19, 3, 28, 16]   # stops land at different steps


def serve(loaded, jobs, overlap: bool, monkeypatch):
    """Outputs of `jobs` [(prompt, params)], submitted 5 ms apart; the number of graph replays
    launched on placeholder ids."""
    lookaheads = []
    original = DecodeGraphs.run

    def counting(self, batch, previous_tokens=None):
        lookaheads.append(previous_tokens is not None)
        return original(self, batch, previous_tokens)
    monkeypatch.setattr(DecodeGraphs, "run", counting)
    config = EngineConfig(num_tokens=512, block_size=16, max_num_seqs=4, max_prefill_tokens=64,
                          device="cuda", overlap=overlap)
    engine = Engine.from_loaded(loaded, config).start()
    assert engine.overlap == overlap and engine.graphs is not None

    async def one(prompt, params, delay):
        await asyncio.sleep(delay)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(one(p, params, 0.005 * i)
                                      for i, (p, params) in enumerate(jobs)))
    try:
        outputs = asyncio.run(main())
        assert_released(engine)
    finally:
        engine.shutdown()
    return outputs, sum(lookaheads)


def test_gpu_overlap_greedy_matches_transformers_and_sync(tmp_path, monkeypatch):
    hf, loaded = gpu_model(tmp_path, "float32")
    prompts = agent_prompts(loaded.tokenizer)
    jobs = [(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, NEW_TOKENS)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p, n in zip(prompts, NEW_TOKENS)]
    overlapped, lookaheads = serve(loaded, jobs, True, monkeypatch)
    sync, sync_lookaheads = serve(loaded, jobs, False, monkeypatch)
    assert overlapped == expected
    assert sync == expected
    assert lookaheads > 20 and sync_lookaheads == 0


def test_gpu_overlap_seeded_sampling_matches_sync(tmp_path, monkeypatch):
    _, loaded = gpu_model(tmp_path, "float32")
    prompts = agent_prompts(loaded.tokenizer)[:4]
    jobs = [(p, SamplingParams(temperature=0.8, top_p=0.95, top_k=50 * (i % 2), seed=i,
                               max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)]
    jobs.append((prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    overlapped, lookaheads = serve(loaded, jobs, True, monkeypatch)
    sync, _ = serve(loaded, jobs, False, monkeypatch)
    assert overlapped == sync
    assert lookaheads > 10


def test_gpu_hybrid_overlap_keeps_snapshots_exact(tmp_path, monkeypatch, moe_ops):
    """A hybrid (Gated DeltaNet) model overlaps its decode steps too, except a step whose
    publishing snapshots the recurrent states: a three-turn conversation with the prefix cache
    (each turn resumes from a snapshot) gives the synchronous engine's tokens."""
    from freetoken.models.loader import load_model
    from tests.engine.test_hybrid_engine import replay_conversation
    from tests.models.test_hybrid_hf import build_hybrid

    # the GPU recurrence takes key heads of 64, 128 or 256
    build_hybrid("qwen3_5_moe", tmp_path, seed=2, max_position_embeddings=256, head_dim=64,
                 linear_key_head_dim=64, linear_value_head_dim=32)
    loaded = load_model(str(tmp_path), device="cuda")
    gen = torch.Generator().manual_seed(8)
    turns = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
             for n in (19, 7, 11)]
    results, counts = {}, {}
    original = DecodeGraphs.run

    def counting(self, batch, previous_tokens=None):
        counts[overlap] = counts.get(overlap, 0) + (previous_tokens is not None)
        return original(self, batch, previous_tokens)
    monkeypatch.setattr(DecodeGraphs, "run", counting)
    for overlap in (True, False):
        config = EngineConfig(num_tokens=512, block_size=16, max_num_seqs=2,
                              max_prefill_tokens=64, device="cuda", overlap=overlap)
        engine = Engine.from_loaded(loaded, config).start()
        assert engine.overlap == overlap and engine.graphs is not None
        try:
            results[overlap] = replay_conversation(engine, turns, tokens=40)
            saved = engine.stats()["state_snapshots_saved"]
        finally:
            engine.shutdown()
        assert saved > 3
    assert results[True] == results[False]
    assert counts.get(True, 0) > 20 and counts.get(False, 0) == 0
