"""A request that fails inside the engine (a fault injected with FREETOKEN_FAULT_MARKER) gets a
500 naming the cause, or an error event once its stream has started, in OpenAI's and
Anthropic's shapes; the streams sharing its batch run on to their end."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tests.server.load_helpers import next_data, open_streams, sse_events, stats, wait_idle

pytestmark = pytest.mark.needs_weights

MARKER = "<<fail here>>"
HEALTHY = 2
HEALTHY_TOKENS = 200   # long enough to be running while the faulty requests come and go
CAUSE = "injected fault"


@pytest.fixture
def served(serve_smollm2, monkeypatch):
    monkeypatch.setenv("FREETOKEN_FAULT_MARKER", MARKER)
    return serve_smollm2(max_num_seqs=4)


def faulty(stream: bool = False, anthropic: bool = False) -> dict:
    message = {"role": "user", "content": f"Say hello {MARKER}"}
    return {"messages": [message], "max_tokens": 8, "stream": stream,
            **({} if anthropic else {"temperature": 0})}


def assert_failed_with_500(served) -> None:
    reply = httpx.post(served.v1 + "/chat/completions", json=faulty(), timeout=300)
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and CAUSE in error["message"]
    reply = httpx.post(served.v1 + "/messages", json=faulty(anthropic=True), timeout=300)
    assert reply.status_code == 500, reply.text
    assert reply.json()["type"] == "error"
    assert reply.json()["error"]["type"] == "api_error"
    assert CAUSE in reply.json()["error"]["message"]


def assert_stream_ended_with_error_event(served) -> None:
    with httpx.stream("POST", served.v1 + "/chat/completions", json=faulty(stream=True),
                      timeout=300) as reply:
        assert reply.status_code == 200   # the headers went out before the engine failed
        events = [data for _, data in sse_events(reply.iter_lines())]
    assert events[-1] == "[DONE]"
    assert set(events[-2]) == {"error"} and CAUSE in events[-2]["error"]["message"]
    with httpx.stream("POST", served.v1 + "/messages", json=faulty(True, anthropic=True),
                      timeout=300) as reply:
        assert reply.status_code == 200
        events = sse_events(reply.iter_lines())
    name, data = events[-1]
    assert name == "error" and data["type"] == "error"
    assert data["error"]["type"] == "api_error" and CAUSE in data["error"]["message"]


def test_a_fault_fails_only_its_own_request(served):
    body = {"prompt": "Count from one to a hundred:", "max_tokens": HEALTHY_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=300))
        lines = [r.iter_lines() for r in open_streams(stack, client, served.url, HEALTHY,
                                                      body=body)]
        for stream in lines:
            next_data(stream)                 # both decode before the faulty ones arrive
        assert_failed_with_500(served)
        assert_stream_ended_with_error_event(served)
        assert stats(served.url)["running"] == HEALTHY, "the healthy streams ended early"
        for stream in lines:
            events = [data for _, data in sse_events(stream)]
            assert events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == HEALTHY_TOKENS
            assert events[-3]["choices"][0]["finish_reason"] == "length"
    after = wait_idle(served.url)
    assert after["requests_finished_error"] == 4
    assert after["requests_finished_length"] == HEALTHY
