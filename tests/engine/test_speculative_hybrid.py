"""Speculative decoding on hybrid (Gated DeltaNet) models: a rejected draft rolls the recurrent
states back (engine/state_rollback.py), so greedy tokens equal plain decoding's (which
tests/engine/test_hybrid_engine.py holds to transformers), whether drafts are accepted or
rejected, and every state slot and page is freed.

A random model never repeats itself, so prompt lookup would propose nothing: the drafts here
come from an oracle that knows plain decoding's output and spoils some draft tokens on
purpose, so both paths (all accepted; rejected and rolled back) run many times."""

import asyncio

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from freetoken.engine.speculative import DraftState
from freetoken.models.loader import load_model
from tests.models.test_hybrid_hf import build_hybrid

NEW_TOKENS = 30


class OracleDrafts:
    """Drafts the known greedy continuation; every third step's last draft token is wrong."""

    def __init__(self, prompt_len: int, expected: list[int], vocab: int):
        self.prompt_len, self.expected, self.vocab = prompt_len, expected, vocab
        self.calls = 0

    def propose(self, ids, k):
        self.calls += 1
        done = len(ids) - self.prompt_len
        draft = list(self.expected[done:done + k])
        if draft and self.calls % 3 == 0:
            draft[-1] = (draft[-1] + 1) % self.vocab
        return draft


def generate(engine, prompts, oracle=None, max_tokens=NEW_TOKENS):
    """Greedy outputs of `prompts` run at once; drafts from `oracle` (each prompt's known
    continuation) where given."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if oracle is not None:
        draft = engine.scheduler.drafter

        def with_oracle(request, budget):
            if request.draft_state is None:
                i = next(i for i, p in enumerate(prompts)
                         if request.token_ids[:len(p)] == p and request.prompt_len == len(p))
                request.draft_state = DraftState(index=OracleDrafts(
                    len(prompts[i]), oracle[i], engine.model.config.vocab_size))
            return draft(request, budget)

        engine.scheduler.drafter = with_oracle

    async def one(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_hybrid_speculation_rolls_states_back(arch, tmp_path, moe_ops):
    build_hybrid(arch, tmp_path)
    loaded = load_model(str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 23, 12)]

    def engine(speculative, k=2):
        return Engine.from_loaded(loaded, EngineConfig(
            num_tokens=512, block_size=8, max_num_seqs=4, max_prefill_tokens=16,
            kv_dtype="float32", speculative=speculative, num_speculative_tokens=k)).start()

    plain = engine("off")
    try:
        expected = generate(plain, prompts)
    finally:
        plain.shutdown()
    for k in (1, 3):
        spec = engine("ngram", k)
        try:
            got = generate(spec, prompts, oracle=expected)
            stats = spec.stats()
        finally:
            spec.shutdown()
        assert got == expected, k
        assert stats["spec_accepted_tokens"] > NEW_TOKENS // 2      # drafts were taken
        assert stats["spec_replays"] > 2                             # and rolled back
        assert stats["state_slots_used"] == 0 and stats["kv_pages_used"] == 0
        assert stats["steps"] < 3 * NEW_TOKENS                      # fewer forwards than tokens
