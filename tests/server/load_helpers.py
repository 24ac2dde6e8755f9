"""Helpers of the overload, fault and shutdown tests: engine stats over HTTP, waiting for the
engine to go idle, long-running streams, and the events of a server-sent event stream."""

from __future__ import annotations

import contextlib
import json
import time

import httpx

# A completion that runs far longer than any of these tests (1000 tokens at tens of tokens
# per second), so it is still streaming whenever a test looks.
LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True,
        "temperature": 0, "stream": True}


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=60).json()


def in_engine(current: dict) -> int:
    return current["running"] + current["waiting"]


def wait_idle(url: str, deadline_s: float = 120.0) -> dict:
    """Poll until no request is running or waiting and no KV page is held (a liveness bound,
    not a speed check); the stats then."""
    end = time.monotonic() + deadline_s
    while True:
        current = stats(url)
        if in_engine(current) == current["kv_pages_used"] == 0:
            return current
        assert time.monotonic() < end, f"requests still hold pages or slots: {current}"
        time.sleep(0.05)


def open_streams(stack: contextlib.ExitStack, client: httpx.Client, url: str, count: int,
                 path: str = "/v1/completions", body: dict | None = None) -> list:
    """`count` streaming requests, each accepted (its headers arrived) before the next is
    sent; leaving `stack` closes their connections."""
    responses = []
    for _ in range(count):
        response = stack.enter_context(client.stream("POST", url + path, json=body or LONG))
        assert response.status_code == 200, response.read()
        responses.append(response)
    return responses


def sse_events(lines) -> list[tuple[str | None, object]]:
    """(event name or None, data: parsed JSON, or the text "[DONE]") for each event."""
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


def next_data(lines) -> dict:
    """The next `data:` payload of an OpenAI stream (the line iterator stays usable)."""
    for line in lines:
        if line.startswith("data: {"):
            return json.loads(line[len("data: "):])
    raise AssertionError("the stream ended before another data event")


def assert_openai_refusal(response: httpx.Response, reason: str) -> None:
    """A 503 with Retry-After in OpenAI's error schema whose message says `reason`."""
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) >= 1
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and reason in error["message"]
