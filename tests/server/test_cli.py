"""`ft ctl`, `ft shell` and `ft serve` end to end."""

import json
import os
import re
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from click.testing import CliRunner

from freetoken.cli.main import main
from tests.server.conftest import API_KEY

QUESTION = "Tell me about paged attention."


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def greedy_reply(server, max_tokens=8) -> str:
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)
    return client.chat.completions.create(
        model=server.loaded.name, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": QUESTION}]).choices[0].message.content


def test_ctl_health_and_stats(server):
    result = CliRunner().invoke(main, ["ctl", "health", "--url", server.url])
    assert result.exit_code == 0 and server.loaded.name in result.output
    result = CliRunner().invoke(main, ["ctl", "stats", "--url", server.url])
    assert result.exit_code == 0
    assert json.loads(result.output)["sampling_defaults"] == "model"


def test_ctl_fails_clearly_when_unreachable_or_unauthorized(keyed_server):
    url = closed_port_url()
    for command in ("health", "stats"):
        result = CliRunner().invoke(main, ["ctl", command, "--url", url])
        assert result.exit_code != 0 and "cannot reach" in result.output
    result = CliRunner().invoke(main, ["ctl", "stats", "--url", keyed_server.url])
    assert result.exit_code != 0 and "401" in result.output
    result = CliRunner().invoke(main, ["ctl", "stats", "--url", keyed_server.url,
                                       "--api-key", API_KEY])
    assert result.exit_code == 0


def test_shell_streams_replies_from_a_server(server):
    expected = greedy_reply(server)
    result = CliRunner().invoke(
        main, ["shell", "--url", server.url, "--temperature", "0", "--max-tokens", "8"],
        input=f"{QUESTION}\n/reset\n{QUESTION}\n/exit\n")
    assert result.exit_code == 0, result.output
    assert result.output.count("assistant> " + expected) == 2  # /reset: same answer again
    assert "(conversation cleared)" in result.output


def test_shell_with_an_in_process_model(server, tiny_model_dir):
    expected = greedy_reply(server)
    result = CliRunner().invoke(
        main, ["shell", "--model", str(tiny_model_dir), "--device", "cpu", "--temperature", "0",
               "--max-tokens", "8"], input=f"{QUESTION}\n")
    assert result.exit_code == 0, result.output
    assert "assistant> " + expected in result.output


def test_serve_prints_its_url_and_serves(tiny_model_dir):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-c", "from freetoken.cli.main import main; main()", "serve",
               "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu",
               "--num-tokens", "1024", "--served-model-name", "tiny", "--api-key", API_KEY,
               "--sampling-defaults", "none", "--log-level", "warning", "--no-prefix-cache"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "FreeToken serving" in line:
                break
        match = re.search(r"at (http://\S+)", lines[-1])
        assert match, "".join(lines)
        url = match.group(1)
        assert httpx.get(url + "/health").json() == {"status": "ok", "model": "tiny",
                                                   "pid": proc.pid}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        assert httpx.get(url + "/v1/models").status_code == 401
        stats = httpx.get(url + "/v1/stats", headers=headers).json()
        assert stats["sampling_defaults"] == "none" and stats["kv_pages_total"] == 1024 // 16
        assert stats["tokens_generated"] == 0  # the warm-up is not counted
        assert stats["prefix_cache"] is False
        reply = httpx.post(url + "/v1/completions", headers=headers, timeout=300,
                           json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_reports_a_bad_model_path(tmp_path):
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path / "missing"),
                                       "--device", "cpu"])
    assert result.exit_code != 0 and "no such file or directory" in result.output


@pytest.mark.parametrize("flags,fragment", [
    (["--kv-dtype", "bfloat16"], "kv_dtype bfloat16 is not available on the CPU"),
    (["--dtype", "float16"], "the CPU computes in float32"),
    (["--kv-dtype", "int4"], "Invalid value for '--kv-dtype'"),
])
def test_serve_refuses_dtypes_the_cpu_cannot_hold(tiny_model_dir, flags, fragment):
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--device", "cpu",
                                       "--port", "0", *flags])
    assert result.exit_code != 0
    assert fragment in result.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_serve_on_cuda_without_a_gpu_says_so(tiny_model_dir):
    result = CliRunner().invoke(main, ["serve", "--model", str(tiny_model_dir), "--device", "cuda",
                                       "--port", "0"])
    assert result.exit_code != 0 and "sees 0 CUDA GPU(s)" in result.output


@pytest.mark.parametrize("value,fragment", [
    ("bogus", "must be a SIZE (24GiB, 24GB, 24G, 512MiB or a number of bytes) or a FRACTION"),
    ("1.5", "a FRACTION must be in (0, 1]"), ("0", "a FRACTION must be in (0, 1]"),
    ("-4GiB", "must be positive"), ("24", "write the unit (24GiB)")])
def test_serve_refuses_a_bad_gpu_memory_limit(value, fragment):
    result = CliRunner().invoke(main, ["serve", "--gpu-memory-limit", value])
    assert result.exit_code == 2
    assert "Invalid value for '--gpu-memory-limit'" in result.output
    assert fragment in result.output


@pytest.mark.parametrize("flags,expected", [
    ([], None), (["--gpu-memory-limit", "none"], None),
    (["--gpu-memory-limit", "24GiB"], (24 << 30, 0.0)),
    (["--gpu-memory-limit", "0.3"], (0, 0.3))])
def test_serve_carries_the_gpu_memory_limit_into_the_engine_config(monkeypatch, flags, expected):
    seen = []
    monkeypatch.setattr("freetoken.cli.serve.run_server",
                        lambda model, dtype, engine_config, *rest: seen.append(engine_config))
    result = CliRunner().invoke(main, ["serve", "--device", "cpu", *flags])
    assert result.exit_code == 0, result.output
    limit = seen[0].gpu_memory_limit
    assert (None if limit is None else (limit.size, limit.fraction)) == expected
