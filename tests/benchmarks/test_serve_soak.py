"""The soak test of benchmarks/serve_soak.py: its checks fed broken runs (counts that disagree,
RSS that grew, an error in the log, pages still held), its stream reader against scripted
events, a server that does not fail faulty requests caught end to end, and the two-minute run
against `ft serve` on the embedded model that CI makes."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from benchmarks import serve_soak, soak_checks, soak_requests
from benchmarks.soak_checks import ServerCounts
from benchmarks.soak_requests import Outcome, SoakRequest, StreamState
from tests.conftest import REPO


def outcome(kind: str, result: str, status: int | None = 200, api: str = "chat") -> Outcome:
    return Outcome(SoakRequest(0, kind, api, {}), result, status)


RUN = ([outcome("chat", "completed")] * 3 + [outcome("cancel", "cancelled")] * 2
       + [outcome("fault", "failed", 500), outcome("invalid", "rejected", 400),
          outcome("chat_stream", "refused", 503)])
AGREEING = ServerCounts({"stop": 1, "length": 2, "abort": 2, "error": 1}, 1,
                        {("/v1/chat/completions", 200): 5, ("/v1/chat/completions", 500): 1,
                         ("/v1/chat/completions", 400): 1, ("/v1/chat/completions", 503): 1})


# ---- the checks, fed broken runs --------------------------------------------------------------

def test_counts_that_agree_pass():
    check = soak_checks.check_counts(RUN, AGREEING)
    assert check.ok, check.detail
    assert "6 accepted requests ended (3 completed, 2 cancelled, 1 failed), 1 refused" \
        in check.detail


@pytest.mark.parametrize("change, named", [
    ({"finished": {"stop": 1, "length": 2, "abort": 1, "error": 1}},
     "cancelled (abort): client 2, server 1"),        # a stream the server never ended
    ({"finished": {"stop": 1, "length": 2, "abort": 2, "error": 2}},
     "failed (error): client 1, server 2"),
    ({"refused": 0}, "refused: client 1, server 0"),
    ({"statuses": {**AGREEING.statuses, ("/v1/chat/completions", 400): 2}},
     "/v1/chat/completions HTTP 400: client 1, server 2"),
])
def test_counts_that_disagree_fail_naming_the_difference(change, named):
    server = ServerCounts(**{**AGREEING.__dict__, **change})
    check = soak_checks.check_counts(RUN, server)
    assert not check.ok and named in check.detail


def test_server_counts_are_read_from_stats_and_metrics_as_differences():
    metrics = "\n".join([
        '# HELP freetoken_requests_total HTTP requests by route and status',
        'freetoken_requests_total{route="/v1/messages",status="200"} 7.0',
        'freetoken_requests_total{route="/v1/completions",status="400"} 2.0',
        'freetoken_requests_total{route="/v1/stats",status="200"} 40.0'])
    stats = {"requests_finished_stop": 3, "requests_finished_length": 4,
             "requests_finished_abort": 1, "requests_finished_error": 0,
             "requests_refused_queue_full": 2, "requests_refused_shutting_down": 1}
    after = ServerCounts.read(stats, metrics)
    assert after.finished == {"stop": 3, "length": 4, "abort": 1, "error": 0}
    assert after.refused == 3
    assert after.statuses == {("/v1/messages", 200): 7, ("/v1/completions", 400): 2}
    before = ServerCounts.read({**stats, "requests_finished_length": 1},
                               metrics.replace("} 7.0", "} 5.0"))
    delta = after.minus(before)
    assert delta.finished["length"] == 3 and delta.refused == 0
    assert delta.statuses == {("/v1/messages", 200): 2}


def test_memory_growth_beyond_the_tolerance_fails():
    mb = 2**20
    assert soak_checks.check_growth("rss", 400 * mb, 418 * mb, 0.05).ok          # +4.5 %
    grown = soak_checks.check_growth("rss", 400 * mb, 430 * mb, 0.05)             # +7.5 %
    assert not grown.ok and "400.0 MiB after warm-up, 430.0 MiB at the end (+7.5%" in grown.detail
    assert soak_checks.check_growth("vram", None, None, 0.05).ok                 # not measured
    assert not soak_checks.check_growth("rss", 400 * mb, None, 0.05).ok          # gone


def test_only_the_injected_faults_may_log_errors():
    fault = ("freetoken: ERROR freetoken.engine: engine step failed: injected fault: the "
             "prompt contains FREETOKEN_FAULT_MARKER")
    assert soak_checks.check_log("ready\n" + fault + "\n" + fault).ok
    crash = "\n".join(["Traceback (most recent call last):", '  File "x.py", line 1, in f',
                       "    boom()", "RuntimeError: page 3 freed twice"])
    check = soak_checks.check_log(fault + "\n" + crash)
    assert not check.ok and "page 3 freed twice" in check.detail
    faulted = crash.replace("page 3 freed twice", "injected fault: the prompt contains it")
    assert soak_checks.check_log(faulted).ok
    assert not soak_checks.check_log("INFO x\nERROR uvicorn: Exception in ASGI application").ok


def test_a_server_still_holding_pages_or_requests_is_not_idle():
    assert soak_checks.check_idle({"running": 0, "waiting": 0, "kv_pages_used": 0}).ok
    held = soak_checks.check_idle({"running": 0, "waiting": 0, "kv_pages_used": 6})
    assert not held.ok and "'kv_pages_used': 6" in held.detail
    assert not soak_checks.check_idle({"running": 1, "waiting": 0, "kv_pages_used": 0}).ok
    assert not soak_checks.check_idle(None).ok


def test_requests_that_end_outside_their_kind_fail():
    assert soak_checks.check_expected(RUN).ok
    wrong = soak_checks.check_expected(RUN + [outcome("fault", "completed"),
                                              outcome("invalid", "completed")])
    assert not wrong.ok and "'fault -> completed': 1" in wrong.detail


# ---- the requests and the stream reader -------------------------------------------------------

def test_the_mix_is_seeded_and_has_no_faults_without_a_marker():
    def draw(marker, seed=3):
        rng = random.Random(seed)
        return [soak_requests.draw_request(i, rng, soak_requests.KINDS, 16, 200, marker)
                for i in range(300)]

    assert draw("<<m>>") == draw("<<m>>") and draw("<<m>>") != draw("<<m>>", seed=4)
    kinds = {r.kind for r in draw("<<m>>")}
    assert kinds == set(soak_requests.KINDS)
    assert "fault" not in {r.kind for r in draw(None)}
    for r in draw("<<m>>"):
        text = json.dumps(r.body)
        assert ("<<m>>" in text) == (r.kind == "fault")
        if r.kind == "cancel":
            assert r.stream and r.body["max_tokens"] == 200
        if r.api == "messages":
            assert "ignore_eos" not in r.body and "stream_options" not in r.body
    assert soak_requests.parse_mix("chat=1,fault=0.5")["fault"] == 0.5
    for bad in ("chat", "nope=1", "chat=0"):
        with pytest.raises(ValueError):
            soak_requests.parse_mix(bad)


def feed(state: StreamState, events) -> StreamState:
    for name, data in events:
        state.feed(name, data if isinstance(data, str) else json.dumps(data))
    return state


def test_the_stream_reader_tells_completed_failed_and_cut_streams():
    token = {"choices": [{"delta": {"content": "a"}, "finish_reason": None}]}
    finish = {"choices": [{"delta": {}, "finish_reason": "length"}]}
    error = {"error": {"message": "generation failed: injected fault: the prompt contains it"}}
    done = feed(StreamState(False), [(None, token), (None, token), (None, finish),
                                     (None, "[DONE]")])
    assert done.events == 2 and done.outcome() == ("completed", "")
    assert feed(StreamState(False), [(None, error), (None, "[DONE]")]).outcome() == ("failed", "")
    assert feed(StreamState(False), [(None, error)]).outcome()[0] == "unexpected"   # no [DONE]
    assert feed(StreamState(False), [(None, token), (None, finish)]).outcome()[0] == "unexpected"
    other = {"error": {"message": "model step failed: CUDA error"}}
    assert feed(StreamState(False), [(None, other), (None, "[DONE]")]).outcome()[0] == "unexpected"
    delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}}
    ended = feed(StreamState(True), [("message_start", {"type": "message_start"}),
                                     ("content_block_delta", delta),
                                     ("message_stop", {"type": "message_stop"})])
    assert ended.events == 1 and ended.outcome() == ("completed", "")
    failed = feed(StreamState(True), [("error", {"type": "error", **error})])
    assert failed.outcome() == ("failed", "")


def test_durations():
    assert [serve_soak.parse_duration(t) for t in ("90", "120s", "20m", "1.5h")] == \
        [90, 120, 1200, 5400]
    for bad in ("0", "5d", "m", "-3s"):
        with pytest.raises(Exception):
            serve_soak.parse_duration(bad)


# ---- real runs --------------------------------------------------------------------------------

@pytest.fixture
def server_without_faults(smollm2_loaded, monkeypatch):
    """SmolLM2 served in this process with no fault marker set, so nothing fails on purpose."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    monkeypatch.delenv("FREETOKEN_FAULT_MARKER", raising=False)
    engine = Engine.from_loaded(smollm2_loaded, EngineConfig(num_tokens=1024, max_num_seqs=4,
                                                             device="cpu")).start()
    thread = ServerThread(create_app(engine, smollm2_loaded.tokenizer,
                                     smollm2_loaded.name)).start()
    yield thread.url
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_loaded():
    from freetoken.models.loader import load_model

    return load_model(None, device="cpu")


@pytest.mark.needs_weights
def test_a_server_that_does_not_fail_faulty_requests_is_caught(server_without_faults):
    report = serve_soak.main(["--url", server_without_faults, "--duration", "5s", "--rate", "2",
                              "--mix", "fault=1,chat_stream=1", "--max-tokens", "4",
                              "--fault-marker", "<<soak-fault>>"])
    checks = {c["name"]: c for c in report["checks"]}
    assert not report["passed"]
    assert not checks["expected"]["ok"] and "fault -> completed" in checks["expected"]["detail"]
    assert checks["counts"]["ok"] and checks["idle"]["ok"]   # what did happen was counted


@pytest.mark.slow
@pytest.mark.needs_weights
def test_a_two_minute_soak_against_ft_serve_passes(tmp_path):
    out, log = tmp_path / "soak.json", tmp_path / "serve.log"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_soak.py"),
                          "--duration", "120s", "--rate", "2", "--threads", "2",
                          "--server-log", str(log), "--results", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["requests"] == 240
    assert all(c["ok"] for c in report["checks"])
    assert {c["name"] for c in report["checks"]} >= {"expected", "counts", "rss", "log", "idle",
                                                     "exit"}
    ran = {kind for kind, counts in report["outcomes"].items() if counts}
    assert ran == set(soak_requests.KINDS)
    assert report["outcomes"]["fault"].get("failed", 0) > 0
    assert report["outcomes"]["cancel"].get("cancelled", 0) > 0
    assert report["outcomes"]["invalid"] == {"rejected": sum(report["outcomes"]["invalid"]
                                                            .values())}
    assert "injected fault" in log.read_text()
