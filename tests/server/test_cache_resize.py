"""Live pool resize over HTTP and `ft ctl cache`, the memory stats, and the memory flags'
validation, on the CPU with the tiny llama (its own engine: the resizes must not disturb the
shared one)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from click.testing import CliRunner

from freetoken.cli.main import main as cli
from tests.engine.tiny_llama import CONTEXT
from tests.server.conftest import _serve


@pytest.fixture(scope="module")
def resizable(tiny_loaded):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine

    config = EngineConfig(num_tokens=2 * CONTEXT, block_size=16, max_num_seqs=4,
                          max_prefill_tokens=64, device="cpu", prefix_cache=False)
    engine = Engine.from_loaded(tiny_loaded, config)
    forward = engine.model.forward

    def slow_forward(*args):
        # NOTE: ~25 ms a step, so a resize posted after a streamed token lands mid-request.
        time.sleep(0.025)
        return forward(*args)

    engine.model = _Slowed(engine.model, slow_forward)
    engine.start()
    thread = _serve(engine, tiny_loaded)
    yield thread.url, engine
    thread.stop()
    engine.shutdown()


class _Slowed:
    """The model with a slowed forward; everything else passes through."""

    def __init__(self, model, forward):
        self._model, self.forward = model, forward

    def __getattr__(self, name):
        return getattr(self._model, name)


def greedy(engine, prompt, tokens, during=None):
    """Greedy token ids; `during(i)` runs after the i-th streamed token."""
    from freetoken.engine.request import SamplingParams

    async def run():
        out = []
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        async for o in engine.generate(prompt, params):
            out.extend(o.token_ids)
            if during is not None:
                await asyncio.to_thread(during, len(out))
        return out

    return asyncio.run(run())


def test_resize_mid_stream_keeps_the_greedy_tokens(resizable):
    url, engine = resizable
    prompt = list(range(40, 140))
    want = greedy(engine, prompt, 40)
    sizes = {2: 4 * CONTEXT, 6: 2 * CONTEXT, 10: 3 * CONTEXT}

    def resize(i):
        if i in sizes:
            r = httpx.post(url + "/v1/cache", json={"kv": sizes[i], "wait": 5}, timeout=60)
            assert r.status_code == 200, r.text
            assert engine.stats()["running"] == 1          # the request is still in flight
            assert r.json()["kv_pool_tokens"] == sizes[i]

    assert greedy(engine, prompt, 40, during=resize) == want
    stats = httpx.get(url + "/v1/stats").json()
    assert stats["kv_pool_tokens"] == 3 * CONTEXT == stats["kv_pages_total"] * 16
    assert stats["kv_pool_bytes"] > 0 and stats["moe_offload"] is False


def test_a_shrink_past_held_pages_is_refused_and_serving_goes_on(resizable):
    url, engine = resizable
    prompt = [10 + i % 240 for i in range(290)]   # 290 tokens: pages 0..18 held meanwhile
    seen = {}

    def shrink(i):
        if i == 2:
            r = httpx.post(url + "/v1/cache", json={"kv": 16}, timeout=60)
            seen["status"], seen["body"] = r.status_code, r.json()
            seen["running"] = engine.stats()["running"]

    tokens = greedy(engine, prompt, 40, during=shrink)
    assert len(tokens) == 40 and seen["running"] == 1
    assert seen["status"] == 409, seen
    assert "held by running requests" in seen["body"]["error"]["message"]
    assert engine.pool.num_pages == engine.stats()["kv_pool_tokens"] // 16 > 1


def test_resize_refuses_bad_bodies_naming_the_field(resizable):
    url, _ = resizable
    for body, field in (({"kv": 0}, "kv"), ({"moe": 1.5}, "moe"), ({"moe": 0}, "moe"),
                        ({"kv": 64, "extra": 1}, "extra"), ({}, "kv"), ({"moe": 0.5}, "moe"),
                        ({"states": 0}, "states"), ({"states": 2}, "states")):
        r = httpx.post(url + "/v1/cache", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert field in (error["param"] or "") + error["message"], (body, error)


def test_a_kv_pool_beyond_host_memory_is_refused_with_numbers(resizable):
    url, engine = resizable
    before = engine.pool.num_pages
    r = httpx.post(url + "/v1/cache", json={"kv": 10**12}, timeout=30)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "does not fit" in message and "kv" in message and "free" in message
    assert engine.pool.num_pages == before


def test_ctl_cache_resizes_and_prints_the_pools(resizable):
    url, _ = resizable
    result = CliRunner().invoke(cli, ["ctl", "cache", "--url", url, "--kv", str(2 * CONTEXT)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["kv_pool_tokens"] == 2 * CONTEXT
    refused = CliRunner().invoke(cli, ["ctl", "cache", "--url", url, "--moe", "0.5"])
    assert refused.exit_code != 0 and "no experts" in refused.output
    refused = CliRunner().invoke(cli, ["ctl", "cache", "--url", url, "--states", "2"])
    assert refused.exit_code != 0 and "no recurrent-state" in refused.output


def test_metrics_show_the_pools(resizable):
    url, _ = resizable
    body = httpx.get(url + "/metrics").text
    for name in ("freetoken_kv_pool_tokens", "freetoken_expert_hits_total",
                 "freetoken_expert_bytes_h2d_total", "freetoken_pinned_host_bytes",
                 "freetoken_expert_cpu_executed_total", "freetoken_expert_prefetched_total",
                 "freetoken_expert_prefetch_hits_total"):
        assert name in body, name


@pytest.mark.parametrize("args, words", [
    (["--moe-cache-rate", "0"], "(0, 1]"),
    (["--moe-cache-rate", "1.5"], "(0, 1]"),
    (["--moe-cache-rate", "lots"], "moe-cache-rate"),
    (["--moe-cpu", "maybe"], "moe-cpu"),
    (["--moe-prefetch", "yes"], "moe-prefetch"),
    (["--num-tokens", "-3"], "negative"),
    (["--num-tokens", "many"], "num-tokens"),
])
def test_serve_rejects_bad_memory_flags(args, words):
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2, result.output
    assert words in result.output


def test_ctl_cache_needs_a_size():
    result = CliRunner().invoke(cli, ["ctl", "cache"])
    assert result.exit_code == 2 and "--kv" in result.output
    result = CliRunner().invoke(cli, ["ctl", "cache", "--moe", "0"])
    assert result.exit_code == 2


def test_serve_refuses_a_plan_beyond_host_memory_before_loading(tiny_model_dir):
    result = CliRunner().invoke(cli, ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                      "--port", "0", "--num-tokens", str(10**12)])
    assert result.exit_code == 1, result.output
    assert "does not fit on the host" in result.output and "kv" in result.output
    assert "loading" not in result.output.split("does not fit")[1]
