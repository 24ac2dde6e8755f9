"""Presence/frequency (OpenAI) and repetition (HF) penalties: the formula on both array kinds,
then greedy generation through the engine against transformers on the same weights."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.penalties import apply_penalties
from freetoken.engine.request import InvalidSamplingParams, SamplingParams
from tests.tolerances import assert_close

NEW_TOKENS = 24


def reference(row: np.ndarray, token_ids, prompt_len, p) -> np.ndarray:
    """The penalties written out token by token."""
    out = row.astype(np.float64).copy()
    for t in set(token_ids):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    generated = token_ids[prompt_len:]
    for t in set(generated):
        out[t] -= p.presence_penalty + p.frequency_penalty * generated.count(t)
    return out


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


@pytest.mark.parametrize("kind", ["numpy", "torch", CUDA])
def test_penalties_follow_the_formula(kind):
    gen = np.random.default_rng(0)
    logits = gen.normal(size=(3, 50)).astype(np.float32) * 3
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(),                                     # untouched
              SamplingParams(repetition_penalty=1.7, frequency_penalty=-0.4)]
    requests = [SimpleNamespace(token_ids=[1, 2, 3, 7, 7, 9, 7, 2], prompt_len=3, params=p)
                for p in params]
    expected = [reference(logits[i], r.token_ids, r.prompt_len, r.params)
                for i, r in enumerate(requests)]
    work = logits.copy() if kind == "numpy" else torch.from_numpy(logits.copy()).to(
        "cuda" if kind == "cuda" else "cpu")
    apply_penalties(work, requests)
    got = work if kind == "numpy" else work.cpu().numpy()
    for i in range(3):
        # a few float32 operations per logit (subtract, scale, divide)
        assert_close(got[i], expected[i], torch.float32, terms=3)
    np.testing.assert_array_equal(got[1], logits[1])


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                dict(repetition_penalty=0), dict(repetition_penalty=float("nan"))])
def test_out_of_range_penalties_are_refused(kw):
    with pytest.raises(InvalidSamplingParams, match=next(iter(kw))):
        SamplingParams(**kw)


def hf_greedy_with_openai_penalties(hf, prompt, presence, frequency) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = hf(torch.tensor([tokens])).logits[0, -1].numpy()
            p = SimpleNamespace(presence_penalty=presence, frequency_penalty=frequency,
                                repetition_penalty=1.0)
            tokens.append(int(np.argmax(reference(logits, tokens, len(prompt), p))))
    return tokens[len(prompt):]


def test_engine_greedy_with_penalties_matches_transformers(tiny):
    hf, loaded, prompts = tiny
    with torch.no_grad():
        expected_repetition = [hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                           do_sample=False, repetition_penalty=4.0,
                                           eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                               for p in prompts]
    expected_openai = [hf_greedy_with_openai_penalties(hf, p, 1.5, 2.0) for p in prompts]
    plain = [hf_greedy_with_openai_penalties(hf, p, 0.0, 0.0) for p in prompts]
    assert expected_openai != plain and expected_repetition != plain  # the penalties matter

    engine = Engine.from_loaded(loaded, EngineConfig(device="cpu", kv_dtype="float32")).start()
    settings = [dict(repetition_penalty=4.0), dict(presence_penalty=1.5, frequency_penalty=2.0),
                {}]

    async def run(prompt, kw):
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():   # all in one batch: a row's penalties must not leak into its neighbours
        return await asyncio.gather(*(run(p, kw) for kw in settings for p in prompts))

    try:
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    n = len(prompts)
    assert results[:n] == expected_repetition
    assert results[n:2 * n] == expected_openai
    assert results[2 * n:] == plain
