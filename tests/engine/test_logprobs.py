"""Token log-probabilities through the engine, against transformers' log_softmax on the same
weights and tokens."""

import asyncio

import numpy as np
import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.logprobs import log_softmax_rows, token_logprob
from freetoken.engine.request import SamplingParams
from tests.tolerances import assert_close

NEW_TOKENS = 8
TOP = 4


def test_log_softmax_and_top_entries_on_both_array_kinds():
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32) * 4
    expected = torch.log_softmax(torch.from_numpy(logits[[2, 0]]), dim=-1).numpy()
    kinds = [logits, torch.from_numpy(logits)]
    if torch.cuda.is_available():
        kinds.append(torch.from_numpy(logits).cuda())
    for kind in kinds:
        rows = log_softmax_rows(kind, [2, 0])
        # log_softmax = x - max - log(sum exp): float32 rounding of the largest logit and
        # of a sum over the vocabulary
        assert_close(rows, expected, torch.float32, terms=logits.shape[1],
                     magnitude=np.abs(logits).max() + np.log(logits.shape[1]))
    entry = token_logprob(expected[0], 7, TOP)
    order = np.argsort(-expected[0], kind="stable")[:TOP]
    assert entry.token_id == 7
    assert_close(np.float64(entry.logprob), expected[0, 7], torch.float32, magnitude=0.0)
    assert [i for i, _ in entry.top] == order.tolist()
    assert token_logprob(expected[0], 7, 0).top == ()


def test_engine_logprobs_match_transformers(tiny):
    hf, loaded, prompts = tiny
    engine = Engine.from_loaded(loaded, EngineConfig(device="cpu", kv_dtype="float32")).start()

    async def run(prompt, logprobs):
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=logprobs, presence_penalty=1.0)
        return [out async for out in engine.generate(prompt, params)]

    async def main():
        return await asyncio.gather(*(run(p, TOP) for p in prompts), run(prompts[0], None))

    try:
        *asked, plain = asyncio.run(main())
    finally:
        engine.shutdown()
    assert all(out.logprobs is None for out in plain)
    for prompt, outputs in zip(prompts, asked):
        tokens = [t for out in outputs for t in out.token_ids]
        entries = [e for out in outputs for e in out.logprobs]
        assert [e.token_id for e in entries] == tokens and len(tokens) == NEW_TOKENS
        with torch.no_grad():
            full = hf(torch.tensor([prompt + tokens])).logits[0].float()
        expected = torch.log_softmax(full[len(prompt) - 1:-1], dim=-1)
        for step, entry in enumerate(entries):
            # the raw model distribution: the presence penalty changes the choice, not these
            # the forward's float32 rounding (as the logits tests), plus the log-sum-exp's
            cfg = loaded.config
            assert_close(np.float64(entry.logprob), expected[step, entry.token_id],
                         torch.float32, magnitude=full[len(prompt) - 1 + step].abs().max(),
                         terms=(cfg.hidden_size + cfg.intermediate_size) * cfg.num_layers
                         + cfg.vocab_size)
            top_ids = [i for i, _ in entry.top]
            assert top_ids == expected[step].topk(TOP).indices.tolist()
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top),
                                                         reverse=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_reports_logprobs_and_applies_penalties(tmp_path):
    """The GPU path (bf16, CUDA graphs): logprob entries follow the tokens, greedy picks the top
    entry, and penalties change the greedy text."""
    from freetoken.models.loader import load_model
    from tests.models.helpers import tiny_hf_model

    tiny_hf_model("llama", tmp_path, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                  hidden_size=128)   # the CUDA attention kernel takes head dims 64/128/256
    gpu = load_model(str(tmp_path), device="cuda")
    prompts = [gpu.tokenizer.encode(f"Story {i}: the fox and the dog " * 2) for i in range(3)]
    engine = Engine.from_loaded(gpu, EngineConfig(device="cuda")).start()

    async def run(prompt, **kw):
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3, **kw)
        return [out async for out in engine.generate(prompt, params)]

    try:
        plain = asyncio.run(run(prompts[2]))
        penalised = asyncio.run(run(prompts[2], repetition_penalty=4.0, presence_penalty=2.0,
                                    frequency_penalty=2.0))
    finally:
        engine.shutdown()
    tokens = [t for out in plain for t in out.token_ids]
    entries = [e for out in plain for e in out.logprobs]
    assert [e.token_id for e in entries] == tokens
    for entry in entries:
        assert entry.logprob <= 0 and entry.top[0][0] == entry.token_id
    assert tokens != [t for out in penalised for t in out.token_ids]
