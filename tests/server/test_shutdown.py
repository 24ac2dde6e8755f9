"""Shutdown with the embedded SmolLM2 on the CPU. SIGTERM on `ft serve`: admission stops at
once, a stream that can finish within --shutdown-timeout finishes, the others end with an
error event, and the process exits cleanly (0, or uvicorn's re-raised SIGTERM). In-process:
the drain refuses new requests before the listener closes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from freetoken.server.shutdown import begin_shutdown
from tests.server.load_helpers import (LONG, assert_openai_refusal, next_data, open_streams,
                                       sse_events, wait_idle)

pytestmark = pytest.mark.needs_weights

GRACE_S = 8
SHORT_TOKENS = 24    # about a second of decoding: finishes well inside the grace period
# Far more than a fast host decodes in the signal check plus the grace period (~12 s): the
# long streams must still be running when the grace period ends.
UNFINISHED = {**LONG, "max_tokens": 4000}
CLEAN_EXITS = (0, -signal.SIGTERM, 128 + signal.SIGTERM)


@contextlib.contextmanager
def ft_serve(*flags: str):
    """`ft serve` in a child process; yields (process, url) once it prints its URL."""
    command = [sys.executable, "-c", "from freetoken.cli.main import main; main()", "serve",
               "--port", "0", "--device", "cpu", "--num-tokens", "16384", "--log-level",
               "warning", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "FreeToken serving" in line:
                break
        match = re.search(r"at (http://\S+)", lines[-1] if lines else "")
        assert match, "".join(lines)
        yield proc, match.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def refused_after_signal(url: str) -> bool:
    """Whether a new request is refused (the listener is closed, or a 503) within a few
    seconds; one sent before the signal was handled is served and the next one tried."""
    end = time.monotonic() + GRACE_S / 2
    while time.monotonic() < end:
        try:
            reply = httpx.post(url + "/v1/completions", timeout=30,
                               json={"prompt": "hi", "max_tokens": 1})
        except httpx.TransportError:
            return True
        if reply.status_code == 503:
            return True
        assert reply.status_code == 200, reply.text
        time.sleep(0.05)
    return False


def test_sigterm_stops_admission_drains_the_streams_and_exits():
    with ft_serve("--max-num-seqs", "2", "--max-queued-requests", "1", "--shutdown-timeout",
                  str(GRACE_S)) as (proc, url), contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=120))
        assert client.get(url + "/v1/stats").json()["max_queued_requests"] == 1
        short, = open_streams(stack, client, url, 1, body={**LONG, "max_tokens": SHORT_TOKENS})
        long, queued = open_streams(stack, client, url, 2, body=UNFINISHED)   # one waits
        lines = {"short": short.iter_lines(), "long": long.iter_lines()}
        next_data(lines["short"])
        next_data(lines["long"])
        proc.send_signal(signal.SIGTERM)
        assert refused_after_signal(url)
        short_events = [data for _, data in sse_events(lines["short"])]
        long_events = [data for _, data in sse_events(lines["long"])]
        queued_events = [data for _, data in sse_events(queued.iter_lines())]
        returncode = proc.wait(timeout=GRACE_S + 60)
        output = proc.stdout.read()
    assert short_events[-1] == "[DONE]"
    assert short_events[-2]["choices"][0]["finish_reason"] == "length"
    for events in (long_events, queued_events):
        assert events[-1] == "[DONE]"
        assert "shutting down" in events[-2].get("error", {}).get("message", ""), events[-2]
    assert returncode in CLEAN_EXITS, output
    assert "Cancel" not in output and "Traceback" not in output, output


def test_a_drain_refuses_new_requests_then_ends_the_running_ones(serve_smollm2):
    served = serve_smollm2(max_num_seqs=2)

    async def drain_and_knock() -> httpx.Response:
        draining = begin_shutdown(served.engine, timeout_s=1.0)
        knock = httpx.post(served.v1 + "/completions", json={"prompt": "hi"}, timeout=60)
        await draining
        return knock

    with httpx.stream("POST", served.v1 + "/completions", json=LONG, timeout=300) as running:
        lines = running.iter_lines()
        next_data(lines)
        assert_openai_refusal(asyncio.run(drain_and_knock()), "shutting down")
        events = [data for _, data in sse_events(lines)]
    assert events[-1] == "[DONE]"
    assert "shutting down" in events[-2]["error"]["message"], events[-2]
    assert wait_idle(served.url)["requests_finished_abort"] == 1
