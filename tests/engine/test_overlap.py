"""Overlap scheduling forced on the CPU: steps launched on placeholder ids must give the same
tokens, stops, usage, stream order, prefix-cache pages and page accounting as synchronous steps
(the fake model's rule and HF transformers are the references)."""

import asyncio
import dataclasses
import random

import numpy as np
import pytest
import torch

import freetoken.engine.overlap_steps as overlap_steps
from freetoken.arrays import Device, HostArrays, TorchArrays, is_torch
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.overlap import fill_placeholders, placeholder
from freetoken.engine.request import SamplingParams
from freetoken.models.batch import KVCache
from tests.engine.fakes import CharTokenizer, FakeModel, expected_continuation

TOK = CharTokenizer()
VOCAB = FakeModel().config.vocab_size


@pytest.fixture
def lookaheads(monkeypatch):
    """Sizes of the steps launched with placeholder ids (before the previous step was read)."""
    sizes = []

    def counting(input_ids, previous):
        if (np.asarray(input_ids) < 0).any():
            sizes.append(len(input_ids))
        return fill_placeholders(input_ids, previous)
    monkeypatch.setattr(overlap_steps, "fill_placeholders", counting)
    return sizes


class TorchFakeModel(FakeModel):
    """The fake model over torch CPU tensors, as a GPU model's arrays are: the engine's torch
    paths (placeholders filled by torch ops, sampling left on the device, the read-back) run
    here. Its rule runs on numpy copies, with a KV pool of its own."""

    def __init__(self):
        super().__init__()
        self.arrays = TorchArrays(Device("cpu"))
        self.host_kv = None

    def forward(self, batch, kv):
        assert is_torch(batch.input_ids) and int(batch.input_ids.min()) >= 0
        if self.host_kv is None:
            self.host_kv = KVCache(self.config, kv.num_blocks, kv.block_size, "float32",
                                   HostArrays())
        host = dataclasses.replace(batch, **{
            f.name: getattr(batch, f.name).numpy() for f in dataclasses.fields(batch)
            if is_torch(getattr(batch, f.name))})
        return torch.from_numpy(super().forward(host, self.host_kv))


@pytest.fixture
def make_engine():
    engines = []

    def make(overlap, num_tokens=512, seqs=8, chunk=32, eos=(), prefix_cache=True,
             model=FakeModel):
        engine = Engine(model(), TOK, EngineConfig(
            num_tokens=num_tokens, block_size=8, max_num_seqs=seqs, max_prefill_tokens=chunk,
            device="cpu", prefix_cache=prefix_cache), None, eos)
        assert not engine.overlap            # off by default on the CPU
        engine.overlap = overlap
        engines.append(engine.start())
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(engine, prompt, **params):
    params.setdefault("temperature", 0.0)
    outs = [o async for o in engine.generate(prompt, SamplingParams(**params))]
    return outs


def run_all(engine, jobs):
    async def main():
        return await asyncio.gather(*(collect(engine, p, **kw) for p, kw in jobs))
    return asyncio.run(main())


def test_placeholders_are_filled_from_the_previous_steps_tokens():
    ids = np.array([5, placeholder(2), 7, placeholder(0)], dtype=np.int64)
    previous = np.array([11, 12, 13], dtype=np.int64)
    assert fill_placeholders(ids, previous).tolist() == [5, 13, 7, 11]
    real = np.array([5, 6], dtype=np.int64)    # after a step that sampled no row
    assert fill_placeholders(real, np.zeros(0, dtype=np.int64)).tolist() == [5, 6]


def test_a_prompt_whose_last_token_is_left_for_a_lookahead_step(make_engine, lookaheads):
    """A chunk that stops one token short of the prompt's end samples nothing; the next
    step, a one-token decode of the real last prompt token, may run as a lookahead."""
    prompt = TOK.encode("x" * 17)               # 16-token chunks: 16, then the 17th alone
    engine = make_engine(True, chunk=16)
    outs = run_all(engine, [(prompt, dict(max_tokens=5, ignore_eos=True))])[0]
    assert [t for o in outs for t in o.token_ids] == expected_continuation(prompt, 5, VOCAB)
    assert engine.model.batches[1].input_ids.tolist() == [prompt[-1]]


def test_late_stops_drop_the_extra_token_and_free_every_page(make_engine, lookaheads):
    """Stops by length, EOS and stop string land one step after the next was launched."""
    prompts = [TOK.encode(t) for t in ("hello world", "the quick brown fox", "abc", "zz top")]
    eos = expected_continuation(prompts[1], 9, VOCAB)[8]
    stop_text = TOK.decode(expected_continuation(prompts[2], 6, VOCAB)[4:6])
    jobs = [(prompts[0], dict(max_tokens=25, ignore_eos=True)),
            (prompts[1], dict(max_tokens=30)),
            (prompts[2], dict(max_tokens=30, stop=[stop_text], ignore_eos=True)),
            (prompts[3], dict(max_tokens=3, ignore_eos=True))]
    engine = make_engine(True, eos=(eos,))
    results = run_all(engine, jobs)
    sync = run_all(make_engine(False, eos=(eos,)), jobs)
    assert len(lookaheads) > 20
    for outs, reference in zip(results, sync):
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs] == \
            [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in reference]
        tokens = [t for o in outs for t in o.token_ids]
        assert [o.usage.completion_tokens for o in outs] == list(range(1, len(tokens) + 1))
    full = expected_continuation(prompts[0], 25, VOCAB)
    assert [t for o in results[0] for t in o.token_ids] == full
    assert results[1][-1].finish_reason == "stop" and results[1][-1].stop_reason == eos
    assert results[2][-1].stop_reason == stop_text
    assert results[3][-1].finish_reason == "length"
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0
    assert stats["tokens_generated"] == sum(len(o) for o in results)
    engine.pool.check_integrity([])


def test_preemption_and_admission_between_lookaheads_keep_tokens(make_engine, lookaheads):
    """A pool too small for all sequences: steps switch between lookahead and synchronous
    (admissions, and preemptions when the arrivals make them) while sequences come and go."""
    prompts = [TOK.encode(f"request {i} " * (1 + i % 3)) for i in range(8)]
    engine = make_engine(True, num_tokens=128, seqs=5, chunk=16)
    jobs = [(p, dict(max_tokens=12 + 3 * i, ignore_eos=True)) for i, p in enumerate(prompts)]
    results = run_all(engine, jobs)
    for (prompt, kw), outs in zip(jobs, results):
        assert [t for o in outs for t in o.token_ids] == \
            expected_continuation(prompt, kw["max_tokens"], VOCAB)
    # whether a preemption happens depends on when the requests arrive (threads): the tokens
    # above must be right either way
    assert lookaheads
    assert engine.stats()["kv_pages_used"] == 0
    engine.pool.check_integrity([])


def test_prefix_cache_publishes_only_known_tokens(make_engine):
    """Pages holding generated tokens are published once their ids are read back: a follow-up
    prompt of prompt + output hits the same cached prefix as with synchronous steps."""
    prompt = TOK.encode("a prompt of some length for the cache ")

    def turns(engine):
        first = run_all(engine, [(prompt, dict(max_tokens=21, ignore_eos=True))])[0]
        follow = prompt + [t for o in first for t in o.token_ids] + TOK.encode("ok")
        second = run_all(engine, [(follow, dict(max_tokens=5, ignore_eos=True))])[0]
        tokens = [t for o in second for t in o.token_ids]
        assert tokens == expected_continuation(follow, 5, VOCAB)
        return second[-1].usage.cached_tokens, tokens

    overlapped, sync = turns(make_engine(True)), turns(make_engine(False))
    assert overlapped == sync
    assert overlapped[0] >= len(prompt) // 8 * 8 + 16   # past the prompt, into the output


def test_a_request_with_penalties_or_logprobs_runs_synchronous_steps(make_engine, lookaheads):
    prompt = TOK.encode("penalised")
    engine = make_engine(True)
    jobs = [(prompt, dict(max_tokens=6, presence_penalty=0.5, ignore_eos=True)),
            (TOK.encode("with logprobs"), dict(max_tokens=6, logprobs=2, ignore_eos=True))]
    results = run_all(engine, jobs)
    assert lookaheads == []
    assert all(o.logprobs is not None for o in results[1])
    # alone afterwards, a plain request overlaps again
    run_all(engine, [(prompt, dict(max_tokens=6, ignore_eos=True))])
    assert lookaheads


def test_seeded_sampling_is_the_same_with_and_without_overlap(make_engine):
    jobs = [(TOK.encode(f"seed {i}"), dict(temperature=0.8, top_p=0.9, seed=i, max_tokens=15,
                                           ignore_eos=True)) for i in range(3)]
    tokens = [[[t for o in outs for t in o.token_ids] for outs in run_all(make_engine(on), jobs)]
              for on in (True, False)]
    assert tokens[0] == tokens[1]


def test_torch_tensors_greedy_and_seeded_rows_in_one_batch(make_engine, lookaheads):
    """Torch logits: greedy and sampled rows combined on the device, the placeholders filled by
    torch ops; the same tokens as synchronous steps, greedy ones as the rule says."""
    prompts = [TOK.encode(f"torch {i} " * (1 + i)) for i in range(4)]
    jobs = [(p, dict(max_tokens=10 + 4 * i, ignore_eos=True, temperature=0.7 * (i % 2),
                     seed=i)) for i, p in enumerate(prompts)]
    runs = [run_all(make_engine(on, model=TorchFakeModel), jobs) for on in (True, False)]
    tokens = [[[t for o in outs for t in o.token_ids] for outs in run] for run in runs]
    assert tokens[0] == tokens[1]
    assert len(lookaheads) > 10
    for (prompt, kw), got in zip(jobs[::2], tokens[0][::2]):
        assert got == expected_continuation(prompt, kw["max_tokens"], VOCAB)


def test_tiny_llama_greedy_tokens_match_with_overlap(tiny):
    """The real model code under continuous batching: the same greedy tokens either way."""
    _, loaded, prompts = tiny
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for overlap in (True, False):
        engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=512, block_size=16,
                                                         max_num_seqs=4, device="cpu"))
        engine.overlap = overlap
        engine.start()

        async def one(prompt, delay):
            await asyncio.sleep(delay)   # arrivals mid-decode: admissions between lookaheads
            return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(one(p, 0.01 * i) for i, p in enumerate(prompts)))
        try:
            outputs.append(asyncio.run(main()))
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_random_workloads_match_the_rule():
    """Random pools, batch limits, chunk sizes, arrivals, EOS, shared prefixes and clients
    that leave early, with overlap on: every stream is the rule's continuation, usage counts
    what was streamed, and every page comes back."""
    rng = random.Random(7)
    for trial in range(30):
        model = (TorchFakeModel if trial % 3 == 0 else FakeModel)()
        eos = rng.randrange(VOCAB)
        engine = Engine(model, TOK, EngineConfig(
            num_tokens=rng.choice([96, 160, 512]), block_size=8, max_num_seqs=rng.choice([2, 4, 8]),
            max_prefill_tokens=rng.choice([8, 16, 64]), device="cpu",
            prefix_cache=rng.random() < 0.7), None, (eos,))
        engine.overlap = True
        jobs = []
        for _ in range(rng.randrange(1, 12)):
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
            if jobs and rng.random() < 0.3:
                prompt = jobs[0][0][:rng.randrange(1, len(jobs[0][0]) + 1)] + prompt
            jobs.append((prompt, rng.randrange(1, 30), rng.random() < 0.5, rng.random() < 0.15,
                         rng.random() * 0.01))

        async def one(prompt, max_tokens, ignore_eos, leaves, delay):
            await asyncio.sleep(delay)
            tokens, last = [], None
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            stream = engine.generate(prompt, params)
            async for last in stream:
                tokens += last.token_ids
                assert last.usage.completion_tokens == len(tokens)
                if leaves and len(tokens) >= 2:
                    break
            await stream.aclose()
            return tokens, last

        async def main():
            return await asyncio.gather(*(one(*job) for job in jobs))
        engine.start()
        try:
            results = asyncio.run(main())
        finally:
            engine.shutdown()
        for (prompt, max_tokens, ignore_eos, leaves, _), (tokens, _) in zip(jobs, results):
            stop = None if ignore_eos else eos
            reference = expected_continuation(prompt, max_tokens, VOCAB, stop)
            assert tokens == (reference[:len(tokens)] if leaves else reference), trial
        assert engine.stats()["kv_pages_used"] == 0, trial
        engine.pool.check_integrity([])
