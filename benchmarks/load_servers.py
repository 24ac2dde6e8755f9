"""The two servers a load run compares, started alike on a free loopback port: `ft serve`
(ready when `ft ctl health --wait` says so) and llama.cpp's `llama-server` (llama_tools'
launcher: ready when /health is 200), both on the same GGUF with the same sequence budget.

Sizing, the same for both: `max_num_seqs` sequences run at once (FreeToken's --max-num-seqs,
llama-server's -np slots, its continuous batching on by default) and the KV holds
max_num_seqs x slot_tokens tokens (FreeToken's --num-tokens; llama-server's -c, split evenly
among the slots), a slot being the longest prompt + output of the run plus the chat template.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import llama_tools

TEMPLATE_TOKENS = 64      # room for the chat template around the user message


class ServerUnavailable(RuntimeError):
    """A server could not start here (binary missing, process exited); the message says why."""


@dataclass(frozen=True)
class ServerPlan:
    """What both servers are given."""

    model: Path            # the GGUF file both load
    device: str            # "cpu" or "cuda"
    threads: int           # CPU threads (FREETOKEN_NUM_THREADS, llama-server's -t)
    max_num_seqs: int
    longest_request: int   # the run's largest prompt + output tokens
    queued: int            # requests that may wait beyond max_num_seqs

    @property
    def slot_tokens(self) -> int:
        """One sequence's KV: the longest request plus the template, in 64-token steps."""
        need = self.longest_request + TEMPLATE_TOKENS
        return -(-need // 64) * 64

    @property
    def kv_tokens(self) -> int:
        return self.max_num_seqs * self.slot_tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ft_command() -> str:
    """The `ft` beside this interpreter (a venv), else the one on PATH (a --target install)."""
    beside = Path(sys.executable).with_name("ft")
    if beside.exists():
        return str(beside)
    found = shutil.which("ft")
    if found is None:
        raise ServerUnavailable("no `ft` beside this Python nor on PATH: install freetoken")
    return found


class FreeTokenServer:
    """`ft serve` in a child process."""

    label = "FreeToken"

    def __init__(self, plan: ServerPlan, env: dict[str, str] | None = None, log=None):
        """`env`: more environment variables for the server; `log`: an open text file its
        output goes to (default: a temporary one)."""
        self.base_url = f"http://127.0.0.1:{free_port()}"
        self._ft = ft_command()
        self.command = [
            self._ft, "serve", "--model", str(plan.model), "--device", plan.device,
            "--port", self.base_url.rsplit(":", 1)[1], "--log-level", "warning",
            "--max-num-seqs", str(plan.max_num_seqs), "--num-tokens", str(plan.kv_tokens),
            # llama-server queues without bound: let every request of the run wait here too
            "--max-queued-requests", str(plan.queued)]
        env = {**os.environ, "FREETOKEN_NUM_THREADS": str(plan.threads), **(env or {})}
        self._log = log or tempfile.TemporaryFile("w+")
        self.spawned = time.perf_counter()
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      env=env)

    def wait_ready(self, wait_s: float = 900.0) -> dict:
        result = subprocess.run([self._ft, "ctl", "health", "--url", self.base_url, "--wait",
                                 str(wait_s), "--pid", str(self._proc.pid)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            self._log.seek(0)
            raise ServerUnavailable(f"ft serve is not ready ({result.stderr.strip()}): "
                                    + self._log.read()[-600:])
        return {"start_to_ready_s": time.perf_counter() - self.spawned}

    def close(self) -> float:
        """Stop it (SIGTERM: it drains, then exits); its peak RSS in MB."""
        return llama_tools.stop_and_peak_rss_mb(self._proc, self._log)

    @property
    def exit_code(self) -> int | None:
        """The process's exit status once it ended (None while it runs)."""
        return self._proc.poll()


class LlamaCppServer:
    """llama.cpp's `llama-server`: the CPU build of benchmarks/build_llama_cpp.sh, or on a GPU
    the CUDA build of `python -m benchmarks.llama_cpp_cuda build` with every layer offloaded."""

    label = "llama-server"

    def __init__(self, plan: ServerPlan):
        gpu = self._gpu = plan.device == "cuda"
        binary = None
        if gpu:
            from benchmarks.llama_cpp_cuda import paths

            try:
                binary = paths.tool("llama-server")
            except paths.PeerUnavailable as exc:
                raise ServerUnavailable(str(exc)) from None
        self._start = lambda repack: llama_tools.LlamaServer(
            str(plan.model), plan.threads, ctx=plan.kv_tokens, gpu=gpu,
            parallel=plan.max_num_seqs, binary=binary, repack=repack)
        try:
            self._server = self._start(True)
        except llama_tools.ToolUnavailable as exc:
            raise ServerUnavailable(str(exc)) from None
        self.base_url = f"http://127.0.0.1:{self._server.port}"

    def wait_ready(self) -> dict:
        """Ready; on the CPU, a server that dies while warming up is started again with
        `--no-repack` and the result says so under "note"."""
        try:
            return self._server.wait_ready()
        except llama_tools.ToolUnavailable as crash:
            if self._gpu:
                raise ServerUnavailable(str(crash)) from None
            # NOTE: on some CPUs ggml's AMX matmul over weights repacked at load dies with
            # SIGILL on the first prompt (llama_tools.bench_round meets it in llama-bench)
            self._server.close()
            first = str(crash).split(":", 1)[0]
        self._server = self._start(False)
        self.base_url = f"http://127.0.0.1:{self._server.port}"
        try:
            ready = self._server.wait_ready()
        except llama_tools.ToolUnavailable as exc:
            raise ServerUnavailable(str(exc)) from None
        return {**ready, "note": f"--no-repack ({first} with weights repacked at load)"}

    def close(self) -> float:
        return self._server.close()


SERVERS = {"freetoken": FreeTokenServer, "llama-server": LlamaCppServer}


def start_server(name: str, plan: ServerPlan):
    """(the named server, started; {"start_to_ready_s"}); ServerUnavailable when it cannot run
    here."""
    server = SERVERS[name](plan)
    try:
        return server, server.wait_ready()
    except BaseException:
        try:
            server.close()
        except Exception:   # NOTE: a process that died has no /proc status: keep its error
            pass
        raise
