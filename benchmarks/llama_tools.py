"""llama.cpp's own tools as benchmark peers: `llama-bench` (prompt and decode speed, flash
attention on) and `llama-server` (spawn until /health answers, server against server).

The binaries come from benchmarks/build_llama_cpp.sh (the llama.cpp that llama-cpp-python
vendors); LLAMA_CPP_BIN names another folder. Missing binaries make the peer unavailable.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
DEFAULT_BIN = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
               / "freetoken-bench" / f"llama.cpp-{VERSION}" / "bin")


class ToolUnavailable(RuntimeError):
    """A llama.cpp tool is not built here; the message says how to build it."""


def tool(name: str) -> Path:
    folder = Path(os.environ.get("LLAMA_CPP_BIN") or DEFAULT_BIN)
    path = folder / name
    if not os.access(path, os.X_OK):
        raise ToolUnavailable(f"{path} not found: run benchmarks/build_llama_cpp.sh "
                              "(or set LLAMA_CPP_BIN)")
    return path


def _flash_attn_args(binary: Path) -> list[str]:
    """`-fa on` where the tool takes on|off|auto, `-fa 1` (llama-bench) or `-fa` (older)."""
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    line = next((ln for ln in text.splitlines() if "--flash-attn" in ln), "")
    if "on|off" in line:
        return ["-fa", "on"]
    if "<0|1>" in line or binary.name == "llama-bench":
        return ["-fa", "1"]
    return ["-fa"]


def _bench_rows(binary: Path, model: str, threads: int, prompt: str, gen: int,
                extra: list[str]) -> list[dict]:
    command = [str(binary), "-m", model, "-t", str(threads), *_flash_attn_args(binary),
               "-p", prompt, "-n", str(gen), "-r", "1", "-o", "json", *extra]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ToolUnavailable(f"llama-bench exited {result.returncode}: "
                              f"{result.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(result.stdout)
    if not all(row.get("flash_attn") in (True, 1, "on", "enabled") for row in rows):
        raise ToolUnavailable(f"llama-bench ran without flash attention: {rows[0]}")
    return rows


def bench_round(model: str, threads: int, prompt_lens: list[int], gen_tokens: int) -> dict:
    """One llama-bench repetition: {prompt_tok_s: {n: rate}, decode_tok_s: rate, prompt_note}.

    Decode and prompt run separately: on some CPUs the prompt runs crash in ggml's AMX matmul
    over weights repacked at load (its default), and then they are run again with `--repack 0`
    (prompt_note says so) while decode keeps the repacked weights.
    """
    binary = tool("llama-bench")
    out: dict = {"prompt_tok_s": {}, "decode_tok_s": None, "prompt_note": ""}
    if gen_tokens:
        out["decode_tok_s"] = _bench_rows(binary, model, threads, "0", gen_tokens, [])[0]["avg_ts"]
    if prompt_lens:
        lens = ",".join(map(str, prompt_lens))
        try:
            rows = _bench_rows(binary, model, threads, lens, 0, [])
        except ToolUnavailable as crash:
            rows = _bench_rows(binary, model, threads, lens, 0, ["--repack", "0"])
            out["prompt_note"] = f"prompt runs with --repack 0 (with repacking: {crash})"
        out["prompt_tok_s"] = {str(row["n_prompt"]): row["avg_ts"] for row in rows}
    return out


class LlamaServer:
    """`llama-server` as a subprocess: start->ready until /health is 200, peak RSS at close.

    With `parallel` slots (`-np`) the `ctx` tokens (`-c`) are split evenly among them (a slot
    holds ctx / parallel); without it the server picks 4 slots sharing one unified KV.
    `binary` names another build (the CUDA peer's); `repack=False` passes `--no-repack`.
    """

    def __init__(self, model: str, threads: int, ctx: int = 4096, gpu: bool = False,
                 parallel: int | None = None, binary: Path | None = None,
                 repack: bool = True):
        binary = binary or tool("llama-server")
        offload = ["-ngl", "99"] if gpu else []
        slots = ["-np", str(parallel)] if parallel else []
        repacking = [] if repack else ["--no-repack"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._log = tempfile.TemporaryFile("w+")
        self.spawned = time.perf_counter()
        self._proc = subprocess.Popen(
            [str(binary), "-m", model, "-t", str(threads), "-c", str(ctx), *slots, *repacking,
             "--port", str(self.port), "--host", "127.0.0.1", *offload, *_flash_attn_args(binary)],
            stdout=subprocess.DEVNULL, stderr=self._log)

    def wait_ready(self) -> dict:
        url = f"http://127.0.0.1:{self.port}/health"
        while True:
            if (code := self._proc.poll()) is not None:
                self._log.seek(0)
                raise ToolUnavailable(f"llama-server exited ({code}): "
                                      + self._log.read()[-400:])
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return {"start_to_ready_s": time.perf_counter() - self.spawned}
            except OSError:
                pass
            time.sleep(0.01)

    def post(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def close(self) -> float:
        return stop_and_peak_rss_mb(self._proc, self._log)


def stop_and_peak_rss_mb(proc: subprocess.Popen, log) -> float:
    """Stop a server process (closing its log file); its peak RSS in MB (nan when it had
    already exited: there is nothing left to read)."""
    if proc.poll() is not None:
        log.close()
        return float("nan")
    status = Path(f"/proc/{proc.pid}/status").read_text()
    proc.terminate()
    proc.wait(timeout=60)
    log.close()
    return int(status.split("VmHWM:")[1].split()[0]) / 1024
