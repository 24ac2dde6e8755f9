"""Resizing a hybrid model's pools while it serves, on the CPU: the recurrent-state pool
(`--states`) and the KV pool keep every running sequence's states, so greedy outputs equal those
of an engine never resized; fewer state slots cap the sequences run at once; a shrink past held
slots and a pool beyond memory are refused with the numbers, the old pool serving on."""

import asyncio

import pytest
import torch

from freetoken.engine import live_resize
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.live_resize import ResizeBusy, apply_resize
from freetoken.engine.memory_plan import MemoryPlanError
from freetoken.engine.request import SamplingParams
from freetoken.models.loader import load_model
from tests.models.test_hybrid_hf import build_hybrid

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3_5_moe")
    build_hybrid("qwen3_5_moe", directory)
    loaded = load_model(str(directory))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (21, 9, 14)]
    return loaded, prompts


def make_engine(loaded, prefix_cache=True):
    config = EngineConfig(num_tokens=256, block_size=8, max_num_seqs=4, max_prefill_tokens=16,
                          prefix_cache=prefix_cache, kv_dtype="float32")
    return Engine.from_loaded(loaded, config)


def generate(engine, prompts, during=None):
    """Greedy tokens of every prompt at once; `during(i)` runs after the first stream's i-th
    token (in a worker thread, as a client's resize would)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def one(prompt, first):
        out = []
        async for o in engine.generate(prompt, params):
            out.extend(o.token_ids)
            if first and during is not None:
                await asyncio.to_thread(during, len(out))
        return out

    async def main():
        return await asyncio.gather(*(one(p, i == 0) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def test_resizes_mid_stream_keep_the_greedy_tokens(hybrid, moe_ops):
    loaded, prompts = hybrid
    reference = make_engine(loaded, prefix_cache=False).start()
    try:
        want = generate(reference, prompts)
    finally:
        reference.shutdown()
    engine = make_engine(loaded).start()
    steps = {1: dict(states=3), 3: dict(kv_tokens=512), 5: dict(states=4),
             7: dict(kv_tokens=192), 9: dict(states=3, kv_tokens=256)}

    def resize(i):
        if i in steps:
            stats = engine.resize_pools(**steps[i], wait=30)
            if "states" in steps[i]:
                assert stats["state_slots_total"] == steps[i]["states"]
            if "kv_tokens" in steps[i]:
                assert stats["kv_pool_tokens"] == steps[i]["kv_tokens"]

    try:
        assert generate(engine, prompts, during=resize) == want
        # one slot: the three run one after the other (each admitted when a slot frees)
        engine.resize_pools(states=1, wait=30)
        assert generate(engine, prompts) == want
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert stats["state_slots_total"] == 1 and stats["state_slots_used"] == 0
    assert stats["state_bytes_total"] == stats["state_bytes_per_slot"]
    assert stats["state_snapshots_restored"] > 0   # the second round resumed from snapshots


def test_a_shrink_past_held_slots_or_beyond_memory_is_refused(hybrid, monkeypatch):
    loaded, _ = hybrid
    engine = make_engine(loaded)       # not started: the test calls the resize directly
    held = [engine.states.allocate() for _ in range(3)]
    with pytest.raises(ResizeBusy, match=r"1 recurrent-state slots past the new size \(2 slots"):
        apply_resize(engine, None, None, 2)
    assert engine.states.num_slots == 4 and engine.kv.num_state_slots == 4
    engine.states.free(held.pop())
    stats = apply_resize(engine, None, None, 3)
    assert stats["state_slots_total"] == 3 == engine.kv.v[0].shape[0]
    with pytest.raises(ValueError, match="--states 5 must be between 1 and --max-num-seqs"):
        apply_resize(engine, None, None, 5)
    monkeypatch.setattr(live_resize, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryPlanError) as info:
        apply_resize(engine, None, None, 4)
    text = str(info.value)
    assert "does not fit" in text and "states" in text and "free" in text
    assert engine.states.num_slots == 3

