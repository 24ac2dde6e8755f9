"""An injected fault (FREETOKEN_FAULT_MARKER) fails its own request inside the engine step; the
requests sharing that step run again and their tokens stay exact, with synchronous steps and
with overlap scheduling forced on the CPU."""

from __future__ import annotations

import asyncio
import time

import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.fakes import CharTokenizer, FakeModel, expected_continuation

TOK = CharTokenizer()
MARKER = "boom"
TOKENS = 60


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def engine(request, monkeypatch):
    monkeypatch.setenv("FREETOKEN_FAULT_MARKER", MARKER)
    model = FakeModel()
    forward = model.forward

    def slow_forward(*args, **kwargs):   # the healthy requests outlast the faulty one
        time.sleep(0.002)
        return forward(*args, **kwargs)

    model.forward = slow_forward
    engine = Engine(model, TOK, EngineConfig(num_tokens=1024, block_size=8, max_num_seqs=4,
                                             max_prefill_tokens=32, device="cpu"))
    engine.overlap = request.param
    yield engine.start()
    engine.shutdown()


def test_a_fault_fails_its_request_alone(engine):
    prompts = [TOK.encode("hello there"), TOK.encode("general kenobi")]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)

    async def main():
        streams = [engine.submit(prompt, params) for prompt in prompts]
        firsts = [await stream.__anext__() for stream in streams]
        faulty = [out async for out in engine.submit(TOK.encode(f"a {MARKER} b"), params)]
        running_then = engine.stats()["running"]
        rest = [[out async for out in stream] for stream in streams]
        return faulty, running_then, [[first, *outs] for first, outs in zip(firsts, rest)]

    faulty, running_then, healthy = asyncio.run(main())
    assert faulty[-1].finish_reason == "error" and "injected fault" in faulty[-1].error
    assert running_then == len(prompts), "the healthy requests ended with the faulty one"
    vocab = engine.model.config.vocab_size
    for prompt, outs in zip(prompts, healthy):
        assert [t for o in outs for t in o.token_ids] == expected_continuation(prompt, TOKENS,
                                                                                vocab)
        assert outs[-1].finish_reason == "length"
    stats = engine.stats()
    assert (stats["requests_finished_error"], stats["requests_finished_length"]) == (1, 2)
    assert stats["kv_pages_used"] == 0 and stats["running"] == stats["waiting"] == 0
