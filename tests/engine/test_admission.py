"""The bounded waiting queue in front of the scheduler (engine/admission.py), its default, and
requests refused or ended by the engine: refused at once when full or closed, every accepted
one counted by its finish reason."""

from __future__ import annotations

import asyncio

import pytest

from freetoken.engine.admission import AdmissionGate, AdmissionRefused
from freetoken.engine.config import (QUEUED_PER_SEQ, EngineConfig, EngineConfigError,
                                     resolve_engine_config)
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from tests.engine.fakes import CharTokenizer, FakeModel

TOK = CharTokenizer()


def test_the_gate_admits_running_plus_queued_then_refuses_and_counts():
    gate = AdmissionGate(max_num_seqs=2, max_queued_requests=3)
    for inside in range(5):
        gate.admit(inside)
    with pytest.raises(AdmissionRefused, match="overloaded") as refused:
        gate.admit(5)
    assert refused.value.reason == "queue_full" and refused.value.retry_after_s >= 1
    gate.close()
    with pytest.raises(AdmissionRefused, match="shutting down"):
        gate.admit(0)
    assert gate.stats()["requests_refused_queue_full"] == 1
    assert gate.stats()["requests_refused_shutting_down"] == 1
    assert gate.stats()["accepting_requests"] is False


def test_the_queue_bound_defaults_to_a_multiple_of_max_num_seqs():
    resolved = resolve_engine_config(EngineConfig(max_num_seqs=3, device="cpu"), 2048)
    assert resolved.max_queued_requests == QUEUED_PER_SEQ * 3
    zero = resolve_engine_config(EngineConfig(max_queued_requests=0, device="cpu"), 2048)
    assert zero.max_queued_requests == 0
    with pytest.raises(EngineConfigError, match="max_queued_requests"):
        EngineConfig(max_queued_requests=-1)


def test_an_engine_refuses_past_its_bound_and_counts_every_end():
    engine = Engine(FakeModel(), TOK, EngineConfig(num_tokens=256, block_size=8, max_num_seqs=1,
                                                   max_queued_requests=1, device="cpu")).start()
    long = SamplingParams(max_tokens=100, ignore_eos=True)

    async def main():
        first, second = (engine.submit(TOK.encode(f"request {i}"), long) for i in range(2))
        with pytest.raises(AdmissionRefused):
            engine.submit(TOK.encode("request 2"), long)
        first.abort()
        return [out async for out in second][-1].finish_reason

    try:
        assert asyncio.run(main()) == "length"
        stats = engine.stats()
        assert (stats["requests_finished_abort"], stats["requests_finished_length"]) == (1, 1)
        assert stats["requests_refused_queue_full"] == 1 and stats["max_queued_requests"] == 1
    finally:
        engine.shutdown()
