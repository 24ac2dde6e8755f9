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
    """Greedy tokens from transformers' full forward over the whole sequence at every step.

    NOTE: not generate(): with its cache, transformers 5.x's qwen3_next picks other tokens
    than its own cache-free forward on the same weights (its qwen3_5_moe agrees)."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(prompt):])
    return out


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
                          prefix_cache=prefix_cache, kv_dtype="float32")
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
    from freetoken.engine.stats import model_stats
    from freetoken.models.config import ModelConfig
    from freetoken.server.metrics import Metrics

    config = ModelConfig("llama", 10, 8, 16, 1, 2, 2, 4, 1e-6, 1e4, 32)
    stats = {"kv_occupancy": 0.0, "running": 1, "waiting": 0, **model_stats(config),
             "state_slots_used": 1, "state_slots_total": 4, "state_bytes_total": 4096}
    text = Metrics(lambda: stats).render()[0].decode()
    assert "freetoken_state_slots_total 4.0" in text
    assert "freetoken_state_bytes_total 4096.0" in text


def replay_conversation(engine, turns, tokens=NEW_TOKENS) -> list[list[int]]:
    """An agent conversation: each turn's prompt is the whole history plus a new message."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    history, outputs = [], []

    async def one(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    for message in turns:
        history = history + message
        out = asyncio.run(one(history))
        outputs.append(out)
        history = history + out
    return outputs


def start_engine(loaded, config, overlap: bool):
    """An engine, with overlap scheduling forced (on the CPU it runs synchronously: the next
    step's forward runs before the previous step is published, as on a GPU)."""
    engine = Engine.from_loaded(loaded, config)
    engine.overlap = overlap
    return engine.start()


@pytest.mark.parametrize("overlap", [False, True])
def test_state_snapshots_resume_turns_with_identical_output(tmp_path, moe_ops, overlap):
    """With the prefix cache on, each turn resumes from the snapshot at the last full page its
    predecessor's prompt and answer reached; the output equals the cache-off engine's (which
    recomputes every turn) and transformers'. With overlap scheduling the next step is launched
    before the snapshotting step is published: the states are copied first (queued before that
    step, keyed at publishing), so every snapshot holds its own page's states."""
    hf = build_hybrid("qwen3_next", tmp_path)
    loaded = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(5)
    turns = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
             for n in (19, 7, 11)]
    results, stats = {}, {}
    for cache in (False, True):
        config = EngineConfig(num_tokens=256, block_size=8, max_num_seqs=2,
                              max_prefill_tokens=64, prefix_cache=cache,
                              kv_dtype="float32")   # float32 KV: exact greedy vs float64
        engine = start_engine(loaded, config, overlap)
        try:
            results[cache] = replay_conversation(engine, turns)
            stats[cache] = engine.stats()
        finally:
            engine.shutdown()
    assert results[True] == results[False]
    on = stats[True]
    # pages of 8; turn 1 (19 prompt tokens, 6 generated: 24 computed) snapshots at 16 (its
    # prompt's last full page) and 24 (its answer's); turn 2 (32 tokens) resumes at 24 and
    # snapshots at 32 (prompt and turn end at once); turn 3 (49 tokens) resumes at 32 and
    # snapshots at 48 (its answer stops at 54, short of the next page)
    assert on["state_snapshots_saved"] == 4 and on["state_snapshots_restored"] == 2
    assert on["prefix_cache_hit_tokens"] == 24 + 32
    assert stats[False]["prefix_cache_hit_tokens"] == 0
    reference = float64_reference(hf)
    history = []
    for message, out in zip(turns, results[True]):
        history = history + message
        assert hf_greedy(reference, [history])[0] == out, len(history)
        history = history + out


@pytest.mark.parametrize("overlap", [False, True])
def test_long_answers_move_the_turn_snapshot_and_the_next_turn_resumes_after_them(tmp_path,
                                                                                   moe_ops,
                                                                                   overlap):
    """Answers of 20 tokens cross two or three pages: each request's end-of-turn snapshot
    moves forward page by page, and the next turn resumes at the last one, not at the prompt's
    snapshot; outputs equal the cache-off engine's."""
    build_hybrid("qwen3_5_moe", tmp_path, seed=2, max_position_embeddings=128)
    loaded = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(8)
    turns = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
             for n in (19, 7, 11)]
    results, stats = {}, {}
    for cache in (False, True):
        config = EngineConfig(num_tokens=512, block_size=8, max_num_seqs=2,
                              max_prefill_tokens=64, prefix_cache=cache, kv_dtype="float32")
        engine = start_engine(loaded, config, overlap)
        try:
            results[cache] = replay_conversation(engine, turns, tokens=20)
            stats[cache] = engine.stats()
        finally:
            engine.shutdown()
    assert results[True] == results[False]
    on = stats[True]
    # turn 1: 19 + 19 computed, snapshots at 16 (prompt), then 24 moved to 32; turn 2 (46
    # tokens) resumes at 32, snapshots 40 (prompt), then 48, 56, 64; turn 3 (77) resumes at 64,
    # snapshots 72, then 80, 88, 96. Resuming at the prompts' snapshots would give 16 + 40.
    assert on["prefix_cache_hit_tokens"] == 32 + 64
    assert on["state_snapshots_saved"] == 11 and on["state_snapshots_restored"] == 2
    # six rows saved at once (two a turn: a moving row replaces its predecessor) in a store
    # of 2 x 2 slots: the least recently used went
    assert on["state_snapshots"] == on["state_snapshots_total"] == 4


def test_overlapped_snapshots_survive_preemption_and_keep_every_row(tmp_path, moe_ops):
    """Overlap scheduling, the prefix cache and a KV pool small enough to preempt: six
    concurrent conversations of two turns (the second resuming from snapshots) give the
    tokens of the cache-off, synchronous engine, and every snapshot row is either keyed or
    free at the end (a request that ends holding a staged row gives it back:
    test_scheduler.py checks that path directly)."""
    build_hybrid("qwen3_5_moe", tmp_path, max_position_embeddings=256)
    loaded = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(7)
    vocab = loaded.config.vocab_size
    shared = torch.randint(0, vocab, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, vocab, (n,), generator=gen).tolist()
               for n in (3, 11, 17, 29, 5, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

    def two_turns(overlap: bool, cache: bool, num_tokens: int):
        config = EngineConfig(num_tokens=num_tokens, block_size=8, max_num_seqs=4,
                              max_prefill_tokens=16, prefix_cache=cache, kv_dtype="float32")
        engine = start_engine(loaded, config, overlap)

        async def one(prompt):
            return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

        async def conversation():
            first = await asyncio.gather(*(one(p) for p in prompts))
            return first, await asyncio.gather(*(one(p + o + [5, 6, 7])
                                                 for p, o in zip(prompts, first)))

        try:
            return asyncio.run(conversation()), engine.stats(), engine.scheduler
        finally:
            engine.shutdown()

    expected, _, _ = two_turns(False, False, 2048)
    got, stats, scheduler = two_turns(True, True, 160)
    assert got == expected
    assert scheduler.num_preemptions > 0 and stats["state_snapshots_restored"] > 0
    store = scheduler.snapshots
    assert len(store._index) + len(store._free) == store.capacity
