import asyncio
import threading
import time

import numpy as np
import pytest

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import RequestRejected, SamplingParams
from freetoken.models.config import GenerationDefaults
from tests.engine.fakes import CharTokenizer, FakeModel, expected_continuation

TOK = CharTokenizer()
GREEDY = dict(temperature=0.0)


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def make_engine(request):
    """Engines with synchronous steps, and with overlap scheduling forced on the CPU (where it
    runs the same placeholder, late-stop and page logic as on a GPU, synchronously)."""
    engines = []

    def make(num_tokens=512, chunk=32, seqs=8, defaults=None, mode="model", eos=()):
        engine = Engine(FakeModel(), TOK, EngineConfig(
            num_tokens=num_tokens, block_size=8, max_num_seqs=seqs, max_prefill_tokens=chunk,
            sampling_defaults=mode, device="cpu"), defaults, eos)
        engine.overlap = request.param
        engines.append(engine.start())
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


async def collect(engine, prompt, **params):
    outs = [o async for o in engine.generate(prompt, SamplingParams(**params))]
    return outs, [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


def test_concurrent_requests_match_their_solo_reference_under_preemption(make_engine):
    engine = make_engine(num_tokens=160, chunk=16, seqs=6)   # 20 pages: too few for all
    prompts = [TOK.encode(f"request number {i} " * (1 + i % 3)) for i in range(10)]

    async def main():
        return await asyncio.gather(*(collect(engine, p, max_tokens=40, **GREEDY)
                                      for p in prompts))

    results = asyncio.run(main())
    vocab = engine.model.config.vocab_size
    for prompt, (outs, ids, text) in zip(prompts, results):
        assert ids == expected_continuation(prompt, 40, vocab)
        assert text == TOK.decode(ids)
        assert outs[-1].finish_reason == "length"
        assert (outs[-1].usage.prompt_tokens, outs[-1].usage.completion_tokens) == (len(prompt), 40)
        assert all(o.finish_reason is None for o in outs[:-1])
    stats = engine.stats()
    assert stats["preemptions"] >= 1
    assert stats["kv_pages_used"] == 0 and stats["running"] == stats["waiting"] == 0
    assert stats["tokens_generated"] >= 400  # recomputation regenerates nothing extra
    for batch in engine.model.batches:
        lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).tolist()
        assert sum(n for n in lens if n > 1) <= 16 and len(lens) <= 6


def test_eos_and_stop_strings_finish_with_stop(make_engine):
    prompt = TOK.encode("hello there")
    reference = expected_continuation(prompt, 30, FakeModel().config.vocab_size)
    eos = reference[4]
    engine = make_engine(eos=(eos,))
    outs, ids, _ = asyncio.run(collect(engine, prompt, max_tokens=30, **GREEDY))
    cut = reference.index(eos)
    assert ids == reference[:cut + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", eos)

    engine = make_engine()
    full_text = TOK.decode(reference)
    stop = full_text[6:8]
    outs, _, text = asyncio.run(collect(engine, prompt, max_tokens=30, stop=[stop], **GREEDY))
    assert text == full_text[:full_text.index(stop)]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop)


def test_abort_frees_pages_at_once_and_ends_the_stream(make_engine):
    engine = make_engine()
    # 400 steps of 10 ms: the request is still running when its first token is read, however
    # late a loaded machine schedules the reader (unslowed, it could finish first)
    engine.model.step_seconds = 0.01

    async def main():
        stream = engine.submit(TOK.encode("a long story"), SamplingParams(max_tokens=400))
        first = await stream.__anext__()
        assert engine.stats()["kv_pages_used"] > 0
        assert engine.abort(stream.request_id)
        used_after_abort = engine.stats()["kv_pages_used"]
        rest = [o async for o in stream]
        return first, used_after_abort, rest

    first, used, rest = asyncio.run(main())
    assert first.finish_reason is None and used == 0
    assert rest[-1].finish_reason == "abort"
    assert engine.abort("no-such-request") is False


def test_leaving_generate_early_aborts(make_engine):
    engine = make_engine()

    async def main():
        gen = engine.generate(TOK.encode("abc"), SamplingParams(max_tokens=400))
        await gen.__anext__()
        await gen.aclose()
        return engine.stats()

    stats = asyncio.run(main())
    assert stats["kv_pages_used"] == 0 and stats["running"] == 0


def test_impossible_requests_are_rejected_before_queueing(make_engine):
    engine = make_engine(num_tokens=64)   # limit 64 tokens per request

    async def submit(prompt, **kw):
        engine.submit(prompt, SamplingParams(**kw))

    with pytest.raises(RequestRejected, match="64 tokens per request"):
        asyncio.run(submit([1] * 64))
    with pytest.raises(RequestRejected, match="max_tokens"):
        asyncio.run(submit([1] * 10, max_tokens=60))
    with pytest.raises(RequestRejected, match="empty"):
        asyncio.run(submit([]))
    with pytest.raises(RequestRejected, match="vocabulary"):
        asyncio.run(submit([10_000]))
    _, ids, _ = asyncio.run(collect(engine, [1] * 10, **GREEDY))
    assert len(ids) == 54  # unset max_tokens fills the rest of the request's limit


def test_failed_step_errors_its_requests_and_the_engine_keeps_serving(make_engine):
    engine = make_engine()
    engine.model.fail_next = True
    outs, _, _ = asyncio.run(collect(engine, TOK.encode("boom"), max_tokens=5))
    assert outs[-1].finish_reason == "error" and "injected failure" in outs[-1].error
    outs, ids, _ = asyncio.run(collect(engine, TOK.encode("fine"), max_tokens=5, **GREEDY))
    assert outs[-1].finish_reason == "length" and len(ids) == 5
    assert engine.stats()["kv_pages_used"] == 0


def test_sampling_defaults_mode(make_engine):
    defaults = GenerationDefaults(temperature=0.0, max_tokens=3)
    prompt = TOK.encode("defaults")
    _, ids, _ = asyncio.run(collect(make_engine(num_tokens=64, defaults=defaults), prompt))
    assert ids == expected_continuation(prompt, 3, FakeModel().config.vocab_size)
    engine = make_engine(num_tokens=64, defaults=defaults, mode="none")
    _, ids, _ = asyncio.run(collect(engine, prompt))
    assert len(ids) == 64 - len(prompt)
    assert engine.stats()["sampling_defaults"] == "none"


def test_seeded_sampling_reproducible_through_the_engine(make_engine):
    engine = make_engine()
    prompt = TOK.encode("seed")
    runs = [asyncio.run(collect(engine, prompt, temperature=1.0, seed=11, max_tokens=12))[1]
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_shutdown_aborts_in_flight_requests(make_engine):
    engine = make_engine()
    engine.model.gate.clear()

    async def main():
        stream = engine.submit(TOK.encode("x"), SamplingParams(max_tokens=100))
        stopper = threading.Thread(target=engine.shutdown)
        stopper.start()
        while engine.is_alive:  # shutdown has begun; the step in flight is held by the gate
            time.sleep(0.001)
        engine.model.gate.set()
        stopper.join()
        return [o async for o in stream]

    assert asyncio.run(main())[-1].finish_reason == "abort"


def test_kv_dtype_resolution():
    from freetoken.engine.config import EngineConfigError, resolve_kv_dtype

    assert resolve_kv_dtype("auto", True, "float32") == "float16"
    assert resolve_kv_dtype("auto", False, "bfloat16") == "bfloat16"
    assert resolve_kv_dtype("float32", True, "float32") == "float32"
    with pytest.raises(EngineConfigError, match="CPU"):
        resolve_kv_dtype("bfloat16", True, "float32")
    with pytest.raises(EngineConfigError, match="activation dtype"):
        resolve_kv_dtype("float16", False, "bfloat16")
    with pytest.raises(EngineConfigError, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")


def test_cpu_engine_pools_are_float16_by_default(make_engine):
    engine = make_engine()
    assert engine.kv_dtype == "float16" and engine.stats()["kv_dtype"] == "float16"
    assert all(pool.dtype == np.float16 for pool in engine.kv.k + engine.kv.v)
