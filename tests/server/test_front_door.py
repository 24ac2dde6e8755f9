"""What a newcomer meets: CPU serving with torch unimportable, one-line failures with the fix,
`--debug` tracebacks, FREETOKEN_LOG_LEVEL, and `ft ctl health --wait`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import torch

from tests.server.test_cli import closed_port_url

# `import torch` raises ImportError in the child: as on a machine where torch is not installed.
BLOCK_TORCH = "import sys; sys.modules['torch'] = None; "
RUN_FT = "from freetoken.cli.main import main; main()"
PROMPT = "the quick brown fox"
NEW_TOKENS = 6


def ft(*args: str, block_torch: bool = False, env: dict | None = None, timeout: float = 300):
    code = (BLOCK_TORCH if block_torch else "") + RUN_FT
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random llama as an F32 GGUF (exactly the HF weights) and HF's greedy tokens
    for as long as each step's top-1/top-2 logit margin is clear (>= 1e-3; float32 sums of
    64-wide dot products differ by ~1e-6 between implementations)."""
    from freetoken.models.loader import load_model
    from tests.models.helpers import tiny_hf_model
    from tests.models.tiny_gguf import write_gguf

    directory = tmp_path_factory.mktemp("tiny-gguf")
    hf = tiny_hf_model("llama", directory)
    path = directory / "tiny.gguf"
    write_gguf(hf, directory, path, "llama", None)
    prompt = load_model(str(path), device="cpu").tokenizer.encode(PROMPT)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    clear = 0
    for scores in out.scores:
        top2 = torch.topk(scores[0], 2).values
        if top2[0] - top2[1] < 1e-3:
            break
        clear += 1
    assert clear >= 1, "the first greedy step is a near-tie; pick another seed"
    return path, tokens[:clear]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def test_cpu_server_serves_with_torch_unimportable(tiny_gguf):
    path, expected = tiny_gguf
    code = BLOCK_TORCH + RUN_FT
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FREETOKEN_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", str(path),
                             "--port", "0", "--device", "auto", "--num-tokens", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "FreeToken serving" in line:
                break
        output = "".join(lines)
        match = re.search(r"at (http://\S+)", output)
        assert match, output
        assert re.search(r"freetoken: \d+ kernels: \d+ from the kernel cache", output), output
        assert "ready" in lines[-1] and "Uvicorn running" not in output  # log level warning
        health = ft("ctl", "health", "--wait", "30", "--url", match.group(1), block_torch=True)
        assert health.returncode == 0 and "ok: tiny" in health.stdout, health.stderr
        reply = _post(match.group(1) + "/v1/completions",
                      {"prompt": PROMPT, "max_tokens": len(expected), "temperature": 0,
                       "ignore_eos": True})
        assert reply["usage"]["completion_tokens"] == len(expected)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # The same greedy tokens as HF transformers on the same weights.
    from freetoken.models.loader import load_model

    tokenizer = load_model(str(path), device="cpu").tokenizer
    assert reply["choices"][0]["text"] == tokenizer.decode(expected)


def nothing_to_load(tmp_path) -> dict:
    """No kernel cache, JIT off, an empty JIT folder: no kernel can load."""
    return {"FREETOKEN_DISABLE_KERNEL_CACHE": "1", "FREETOKEN_DISABLE_JIT": "1",
            "FREETOKEN_JIT_DIR": str(tmp_path / "empty-jit")}


def test_serve_with_cache_disabled_and_jit_off_is_one_line(tiny_gguf, tmp_path):
    env = nothing_to_load(tmp_path)
    result = ft("serve", "--model", str(tiny_gguf[0]), "--port", "0", "--device", "cpu", env=env)
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "FREETOKEN_DISABLE_KERNEL_CACHE" in errors[0] and "FREETOKEN_DISABLE_JIT" in errors[0]
    assert "Traceback" not in result.stderr
    for debug in (["--debug"], []):   # --debug, or FREETOKEN_LOG_LEVEL=debug: the traceback
        level = {} if debug else {"FREETOKEN_LOG_LEVEL": "debug"}
        result = ft(*debug, "serve", "--model", str(tiny_gguf[0]), "--device", "cpu",
                    env={**env, **level})
        assert result.returncode != 0 and "Traceback" in result.stderr
        assert "KernelUnavailable" in result.stderr


def test_kernels_verify_says_disabled_naming_both_variables(tmp_path):
    env = nothing_to_load(tmp_path)
    result = ft("kernels", "verify", env=env)
    errors = error_lines(result.stderr)
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert "disabled (FREETOKEN_DISABLE_KERNEL_CACHE" in errors[0]
    assert "disabled (FREETOKEN_DISABLE_JIT" in errors[0]
    assert "none installed" not in result.stdout + result.stderr


def test_doctor_without_torch_reports_it_without_a_traceback():
    result = ft("doctor", block_torch=True)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr
    assert "torch: not installed (CPU serving needs none" in result.stdout


def test_cuda_without_torch_names_the_install_command(tiny_gguf):
    result = ft("serve", "--model", str(tiny_gguf[0]), "--device", "cuda", block_torch=True)
    errors = error_lines(result.stderr)
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert "pip install 'freetoken[cuda]'" in errors[0] and "Traceback" not in result.stderr


def test_unexpected_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    not_json = tmp_path / "index.json"
    not_json.write_text("{")
    env = {"FREETOKEN_KERNEL_CACHE_DIR": str(tmp_path), "FREETOKEN_DISABLE_JIT": "1"}
    result = ft("kernels", env=env)
    errors = error_lines(result.stderr)
    assert result.returncode == 1 and len(errors) == 1 and "index.json" in errors[0]
    assert "Traceback" not in result.stderr and "--debug" in errors[0]
    result = ft("--debug", "kernels", env=env)
    assert result.returncode == 1 and "Traceback" in result.stderr


def test_health_wait_stops_when_the_server_process_exits():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    result = ft("ctl", "health", "--wait", "60", "--pid", str(dead.pid),
                "--url", closed_port_url(), timeout=30)
    assert result.returncode == 1 and "exited before it was ready" in result.stderr


def _health_server(body: dict):
    """A stand-in HTTP server answering /health with `body`; returns (server, url)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_health_wait_ignores_another_server_on_the_port():
    """A server that failed to bind (its process exited) is not reported ready because an
    older server answers on the same port; that one's pid is named."""
    other, url = _health_server({"status": "ok", "model": "old", "pid": os.getpid()})
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        result = ft("ctl", "health", "--wait", "60", "--pid", str(dead.pid), "--url", url,
                    timeout=30)
        assert result.returncode == 1 and "exited before it was ready" in result.stderr
        assert f"another server, pid {os.getpid()}" in result.stderr
        # the same answer counts for the process that serves it
        ok = ft("ctl", "health", "--wait", "5", "--pid", str(os.getpid()), "--url", url,
                timeout=30)
        assert ok.returncode == 0 and "ok: old" in ok.stdout
    finally:
        other.shutdown()
