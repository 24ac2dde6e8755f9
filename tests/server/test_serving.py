"""Concurrency, client disconnects, health, stats and metrics."""

import asyncio
import json
import os
import socket
import time

import httpx
import openai
import pytest

PROMPTS = [f"Client number {i} asks about item {i * 7}." for i in range(16)]


def stats(server) -> dict:
    return httpx.get(server.v1 + "/stats", timeout=60).json()


def wait_idle(server, deadline_s=120.0) -> dict:
    """Poll until no request holds KV pages (a liveness bound, not a speed check)."""
    end = time.monotonic() + deadline_s
    while True:
        current = stats(server)
        if current["running"] == current["waiting"] == current["kv_pages_used"] == 0:
            return current
        assert time.monotonic() < end, f"requests still hold KV pages: {current}"
        time.sleep(0.05)


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Each engine step takes at least 5 ms, so a long request is still running when the
    client goes away (the tiny model alone can finish hundreds of tokens in that time)."""
    forward = server.engine.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.005)
        return forward(*args, **kwargs)

    monkeypatch.setattr(server.engine.model, "forward", slow_forward)


def test_sixteen_concurrent_streams_match_their_solo_greedy_runs(server):
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=600)
    solo = [client.completions.create(model=server.loaded.name, prompt=p, max_tokens=24,
                                      temperature=0).choices[0].text for p in PROMPTS]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=server.loaded.name, prompt=prompt,
                                                  max_tokens=24, temperature=0, stream=True)
        pieces, finish = [], None
        async for chunk in stream:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0,
                                      timeout=600) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    results = asyncio.run(main())
    assert [text for text, _ in results] == solo
    assert all(finish in ("length", "stop") for _, finish in results)
    wait_idle(server)


def test_client_disconnect_mid_stream_frees_pages(server, slow_steps):
    before = wait_idle(server)
    body = {"prompt": "A long story begins", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: {") or line == "" for line in received)
        during = stats(server)
        assert during["running"] == 1 and during["kv_pages_used"] > 0
    after = wait_idle(server)
    generated = after["tokens_generated"] - before["tokens_generated"]
    assert generated < 400, "the request ran to the end instead of being aborted"
    assert after["requests_finished"] == before["requests_finished"] + 1


def test_disconnect_during_non_stream_request_aborts_it(server, slow_steps):
    before = wait_idle(server)
    body = json.dumps({"prompt": "Another long story", "max_tokens": 450,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n"
                       b"Content-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        deadline = time.monotonic() + 60
        while stats(server)["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    after = wait_idle(server)
    generated = after["tokens_generated"] - before["tokens_generated"]
    assert generated < 450, "the request ran to the end instead of being aborted"


def test_health_reports_the_model(server):
    r = httpx.get(server.url + "/health")
    # in this process: the fixture serves from a thread
    assert r.status_code == 200 and r.json() == {"status": "ok", "model": server.loaded.name,
                                                 "pid": os.getpid()}


def test_stats_show_sampling_defaults_and_pool(server):
    current = stats(server)
    assert current["sampling_defaults"] == "model"
    assert current["model"] == server.loaded.name
    assert current["kv_pages_total"] * current["kv_block_size"] >= current["max_request_tokens"]
    for key in ("running", "waiting", "kv_pages_used", "tokens_generated"):
        assert isinstance(current[key], int)


def test_metrics_expose_the_documented_names(server):
    httpx.post(server.v1 + "/completions", json={"prompt": "m", "max_tokens": 2}, timeout=300)
    httpx.post(server.v1 + "/completions", json={"prompt": "m", "oops": 2}, timeout=300)
    text = httpx.get(server.url + "/metrics").text
    for name in ("freetoken_requests_total", "freetoken_prompt_tokens_total",
                 "freetoken_generation_tokens_total", "freetoken_time_to_first_token_seconds",
                 "freetoken_e2e_request_latency_seconds", "freetoken_kv_cache_usage_ratio",
                 "freetoken_num_requests_running", "freetoken_num_requests_waiting"):
        assert name in text
    assert 'freetoken_requests_total{route="/v1/completions",status="200"}' in text
    assert 'freetoken_requests_total{route="/v1/completions",status="400"}' in text
