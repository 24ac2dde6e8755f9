"""The engine over the real model code: chunked prefill, paging and preemption must not change
greedy outputs, checked against HF transformers generating from the same weights."""

import asyncio

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.tiny_llama import write_tiny_llama

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-engine")
    write_tiny_llama(directory)
    return directory


@pytest.fixture(scope="module")
def prompts(model_dir):
    from freetoken.models.loader import load_model

    tokenizer = load_model(str(model_dir), device="cpu").tokenizer
    texts = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
             for i in range(6)]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def test_chunked_prefill_and_preemption_match_transformers(model_dir, prompts, hf_greedy):
    from freetoken.models.loader import load_model

    loaded = load_model(str(model_dir), device="cpu")
    # 16-token chunks split every prompt; 12 pages of 16 cannot hold all six sequences at once.
    config = EngineConfig(num_tokens=192, block_size=16, max_num_seqs=6, max_prefill_tokens=16,
                          device="cpu")
    engine = Engine.from_loaded(loaded, config).start()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(run(p) for p in prompts))

    try:
        results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert max(len(p) for p in prompts) > 16
    assert results == hf_greedy
    assert stats["preemptions"] >= 1 and stats["kv_pages_used"] == 0
