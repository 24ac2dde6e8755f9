"""Overload on the CPU with the embedded SmolLM2: once --max-num-seqs run and
--max-queued-requests wait, more requests are refused at once, 503 (OpenAI) or 529 (Anthropic)
with Retry-After, in each API's error schema; clients that leave mid-stream under load free
every page and slot; a closed gate (shutdown) refuses the same way."""

from __future__ import annotations

import contextlib

import anthropic
import httpx
import openai
import pytest

from tests.server.load_helpers import (assert_openai_refusal, in_engine, next_data, open_streams,
                                       stats, wait_idle)

pytestmark = pytest.mark.needs_weights

RUNNING, QUEUED = 2, 2
SHORT = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
MESSAGE = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}


@pytest.fixture
def served(serve_smollm2):
    return serve_smollm2(max_num_seqs=RUNNING, max_queued_requests=QUEUED)


def assert_anthropic_refusal(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 529, response.text
    assert int(response.headers["Retry-After"]) >= 1
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == "overloaded_error" and reason in body["error"]["message"]


def refused_count(url: str, reason: str) -> float:
    line = f'freetoken_requests_refused_total{{reason="{reason}"}} '
    text = httpx.get(url + "/metrics", timeout=60).text
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def test_a_full_queue_is_refused_at_once_with_retry_after(served):
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=300))
        open_streams(stack, client, served.url, RUNNING + QUEUED)
        assert in_engine(stats(served.url)) == RUNNING + QUEUED
        assert_openai_refusal(httpx.post(served.v1 + "/completions", json=SHORT, timeout=60),
                              "overloaded")
        assert_openai_refusal(httpx.post(served.v1 + "/chat/completions", json=CHAT,
                                         timeout=60), "overloaded")
        assert_anthropic_refusal(httpx.post(served.v1 + "/messages", json=MESSAGE, timeout=60),
                                 "overloaded")
        with pytest.raises(openai.InternalServerError) as refused:
            openai.OpenAI(base_url=served.v1, api_key="x", max_retries=0).completions.create(
                model=served.loaded.name, **SHORT)
        assert refused.value.status_code == 503
        with pytest.raises(anthropic.APIStatusError) as overloaded:
            anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
                model=served.loaded.name, **MESSAGE)
        assert overloaded.value.status_code == 529
        # refused without waiting: the four admitted requests are all still inside
        current = stats(served.url)
        assert in_engine(current) == RUNNING + QUEUED
        assert current["requests_refused_queue_full"] == 5
        assert refused_count(served.url, "queue_full") == 5
    wait_idle(served.url)
    assert httpx.post(served.v1 + "/completions", json=SHORT, timeout=300).status_code == 200


def test_clients_leaving_mid_stream_under_load_free_pages_and_slots(served):
    before = wait_idle(served.url)
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=300))
        streams = open_streams(stack, client, served.url, RUNNING + QUEUED)
        # NOTE: keep each line iterator: one dropped half-read closes its connection
        lines = [response.iter_lines() for response in streams[:RUNNING]]   # these two run
        for stream in lines:
            next_data(stream)
            next_data(stream)
        during = stats(served.url)
        assert (during["running"], during["waiting"]) == (RUNNING, QUEUED)
        assert during["kv_pages_used"] > 0
    after = wait_idle(served.url)
    assert after["requests_finished_abort"] == before["requests_finished_abort"] + 4
    assert after["requests_finished"] == before["requests_finished"] + 4
    assert after["tokens_generated"] - before["tokens_generated"] < 2 * 1000, \
        "the streams ran to the end instead of being aborted"
    metrics = httpx.get(served.url + "/metrics", timeout=60).text
    assert 'freetoken_requests_finished_total{reason="abort"} 4.0' in metrics


def test_a_closed_gate_refuses_every_protocol(served):
    served.engine.stop_admission()      # the first step of a shutdown
    assert_openai_refusal(httpx.post(served.v1 + "/completions", json=SHORT, timeout=60),
                          "shutting down")
    assert_anthropic_refusal(httpx.post(served.v1 + "/messages", json=MESSAGE, timeout=60),
                             "shutting down")
    current = stats(served.url)
    assert current["accepting_requests"] is False
    assert current["requests_refused_shutting_down"] == 2
    assert in_engine(current) == 0
