"""`ft serve -tp 2` on the CPU, end to end, with no compiler on PATH and the JIT off (nothing is
compiled for tensor parallelism): a request served by two processes gives TP=1's greedy
tokens; a worker killed (or stopped) ends the server within the bound, with one line naming
the rank and the cause, and no process is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import compiler_free_env
from tests.models.helpers import tiny_hf_model

PROMPT = [5, 17, 33, 8, 99, 120]
TIMEOUT_S = 4          # FREETOKEN_TP_TIMEOUT for these servers
# the watchdog looks every 0.5 s; a fault stops uvicorn (graceful wait up to 5 s) or, at the
# latest, exits the process 15 s after the line
BOUND_S = TIMEOUT_S + 1 + 15 + 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from freetoken.arrays import parse_device
    from freetoken.kernel.preload import load_kernels, plan_kernels

    cpu = parse_device("cpu")     # every kernel ready (cache or JIT) before the compiler goes
    load_kernels(cpu, plan_kernels(cpu), lambda message: None)
    folder = tmp_path_factory.mktemp("tp-serve-qwen3")
    tiny_hf_model("qwen3", folder, seed=9)
    return folder


def _start(model_dir) -> tuple[subprocess.Popen, str, int, list[str]]:
    """A `ft serve -tp 2` process, its URL, rank 1's pid and the lines it printed so far."""
    env = compiler_free_env({"PYTHONUNBUFFERED": "1", "FREETOKEN_TP_TIMEOUT": str(TIMEOUT_S),
                             "FREETOKEN_DISABLE_JIT": "1"})
    command = [sys.executable, "-c", "from freetoken.cli.main import main; main()", "serve",
               "--model", str(model_dir), "--port", "0", "--device", "cpu", "-tp", "2",
               "--num-tokens", "512", "--log-level", "warning", "--sampling-defaults", "none",
               "--served-model-name", "tiny"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "FreeToken serving" in line:
            break
    text = "".join(lines)
    url, pid = re.search(r"at (http://\S+)", text), re.search(r"rank 1 started \(pid (\d+)", text)
    if not url or not pid:
        proc.kill()
        pytest.fail(text)
    return proc, url.group(1), int(pid.group(1)), lines


def _tp1_greedy(model_dir, count: int) -> list[int]:
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    engine = Engine.from_loaded(load_model(str(model_dir), device="cpu"),
                                EngineConfig(device="cpu", num_tokens=512)).start()

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True)
        return [t async for out in engine.generate(PROMPT, params) for t in out.token_ids]

    try:
        return asyncio.run(run())
    finally:
        engine.shutdown()


def _ends_naming(proc, lines: list[str], fragment: str) -> float:
    """Seconds until the server exits; asserts a non-zero exit and the named line."""
    start = time.monotonic()
    try:
        rest, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the server did not stop within {BOUND_S} s: {''.join(lines)}")
    took = time.monotonic() - start
    output = "".join(lines) + rest
    named = [line for line in output.splitlines() if "tensor-parallel rank 1" in line
             and "stopping the server" in line]
    assert proc.returncode != 0, output
    assert len(named) == 1 and fragment in named[0], output
    return took


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_served_request_matches_tp1_and_a_killed_worker_ends_the_server(model_dir):
    proc, url, worker, lines = _start(model_dir)
    try:
        stats = httpx.get(url + "/v1/stats").json()
        assert stats["tensor_parallel_size"] == 2
        assert [r["rank"] for r in stats["ranks"]] == [0, 1]
        metrics = httpx.get(url + "/metrics").text
        assert "freetoken_tensor_parallel_size 2.0" in metrics
        assert 'freetoken_rank_kv_pool_bytes{device="cpu",rank="1"}' in metrics
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}).json()
        assert "choices" in reply, reply
        tokens = reply["choices"][0]["logprobs"]["tokens"]
        assert len(tokens) == 8
        expected = _tp1_greedy(model_dir, 8)
        tokenizer_ids = [int(t.split(":", 1)[1]) if t.startswith("token_id:") else None
                         for t in tokens]
        if None in tokenizer_ids:   # logprobs name tokens by text: compare the texts
            from freetoken.models.loader import load_model

            text = load_model(str(model_dir), device="cpu").tokenizer.decode(expected)
            assert reply["choices"][0]["text"] == text
        else:
            assert tokenizer_ids == expected
        # `ft ctl cache --kv`: every rank's pool is replaced, the same tokens come out
        resized = httpx.post(url + "/v1/cache", json={"kv": 256}, timeout=60).json()
        assert resized["kv_pool_tokens"] == 256, resized
        again = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()
        assert again["choices"][0]["text"] == reply["choices"][0]["text"]
        assert httpx.get(url + "/v1/stats").json()["ranks"][1]["kv_pool_bytes"] == \
            stats["ranks"][1]["kv_pool_bytes"] // 2
        os.kill(worker, signal.SIGKILL)
        took = _ends_naming(proc, lines, "was killed by signal SIGKILL")
        assert took < BOUND_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _gone(worker)


def test_a_stopped_worker_ends_the_server_within_the_timeout(model_dir):
    proc, url, worker, lines = _start(model_dir)
    try:
        os.kill(worker, signal.SIGSTOP)
        took = _ends_naming(proc, lines, "stopped responding")
        assert took < BOUND_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    assert _gone(worker)


def test_stopping_the_server_stops_its_workers(model_dir):
    proc, url, worker, lines = _start(model_dir)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(worker)
