"""The load generator of benchmarks/serve_load.py: its statistics from synthetic chunk times,
the seeded Poisson schedule and length draws, the SSE client against scripted replies, the
side-by-side table, and one short real run against `ft serve` on the embedded model."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest

from benchmarks import llama_tools, load_client, load_report, load_servers, load_stats, serve_load
from benchmarks.load_stats import RequestRecord
from benchmarks.load_workload import (LengthDistribution, RequestSpec, WorkloadError,
                                      arrival_times)


# ---- statistics --------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [[3.0], [1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 9.0, 2.0, 2.0, 7.5],
                                    list(np.random.default_rng(0).exponential(size=101))])
def test_percentiles_match_numpy(values):
    for q in (0, 50, 90, 99, 100):
        assert load_stats.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert load_stats.percentile([], 50) is None


def record(sent, chunks, tokens=None, asked=0, error=None, index=0):
    return RequestRecord(index=index, sent=sent, chunk_times=list(chunks),
                         ended=(chunks[-1] if chunks else sent) + 0.01,
                         completion_tokens=tokens, asked_tokens=asked, error=error)


def test_ttft_tpot_and_itl_from_a_chunk_timeline():
    r = record(10.0, [10.5, 10.6, 10.8, 11.1], tokens=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.6 / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.latency == pytest.approx(1.11)
    # the server's token count wins over the chunks (a token ending mid-character streams none)
    assert record(10.0, [10.5, 10.6, 10.8, 11.1], tokens=7).tpot == pytest.approx(0.6 / 6)
    assert record(10.0, [10.5, 10.6]).output_tokens == 2          # no usage: chunks count
    assert record(10.0, [10.5], tokens=1).tpot is None
    assert record(10.0, []).ttft is None


def test_summary_rates_percentiles_goodput_and_errors():
    records = [record(0.0, [0.2, 0.3, 0.4], tokens=3, asked=3, index=0),   # meets both targets
               record(0.0, [0.9, 1.0, 1.1], tokens=3, asked=3, index=1),   # TTFT 900 ms > 500
               record(1.0, [1.1, 1.5, 1.9], tokens=3, asked=3, index=2),   # TPOT 400 ms > 250
               record(1.5, [1.6, 1.7], tokens=2, asked=3, index=3),        # short, on target
               record(0.5, [], error="http_503", index=4),
               record(0.5, [0.7], error="stream_error", index=5)]
    s = load_stats.summarize(records, ttft_slo=0.5, tpot_slo=0.25)
    assert (s["requests"], s["completed"], s["short_outputs"]) == (6, 4, 1)
    assert s["errors"] == {"http_503": 1, "stream_error": 1}
    assert s["duration_s"] == pytest.approx(1.91)                  # first sent -> last ended
    assert s["requests_per_s"] == pytest.approx(4 / 1.91)
    assert s["output_tokens"] == 11
    assert s["output_tok_per_s"] == pytest.approx(11 / 1.91)
    assert s["goodput"]["met"] == 2
    assert s["goodput"]["requests_per_s"] == pytest.approx(2 / 1.91)
    assert s["goodput"]["fraction"] == pytest.approx(2 / 6)
    assert s["ttft_s"]["p50"] == pytest.approx(np.percentile([0.2, 0.9, 0.1, 0.1], 50))
    itls = [0.1, 0.1, 0.1, 0.1, 0.4, 0.4, 0.1]
    assert s["itl_s"]["p90"] == pytest.approx(np.percentile(itls, 90))
    no_target = load_stats.summarize(records)
    assert no_target["goodput"]["met"] == 4


# ---- the schedule and the lengths -------------------------------------------------------------

def test_poisson_arrivals_are_seeded_and_keep_the_mean_rate():
    times = arrival_times(4.0, 20000, seed=7)
    assert times == arrival_times(4.0, 20000, seed=7)
    assert times != arrival_times(4.0, 20000, seed=8)
    gaps = np.diff([0.0, *times])
    assert all(g > 0 for g in gaps)
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.03)
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)     # exponential: std = mean
    assert arrival_times(float("inf"), 5, seed=0) == [0.0] * 5
    with pytest.raises(WorkloadError):
        arrival_times(0.0, 5, seed=0)


def test_length_distributions():
    rng = random.Random(0)
    assert LengthDistribution.parse("128").draw(rng) == 128
    uniform = [LengthDistribution.parse("10-20").draw(rng) for _ in range(500)]
    assert min(uniform) == 10 and max(uniform) == 20
    normal = [LengthDistribution.parse("normal:100,10").draw(rng) for _ in range(2000)]
    assert np.mean(normal) == pytest.approx(100, rel=0.02)
    assert min(LengthDistribution.parse("normal:2,50").draw(rng) for _ in range(200)) == 1
    assert str(LengthDistribution.parse("normal:100,10")) == "normal:100,10"
    for bad in ("0", "20-10", "x", "normal:5", "normal:0,1"):
        with pytest.raises(WorkloadError):
            LengthDistribution.parse(bad)


# ---- the client against scripted replies -------------------------------------------------------

def sse(*payloads) -> bytes:
    return "".join(f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n"
                   for p in payloads).encode()


def chunk(text=None, finish=None) -> dict:
    delta = {"content": text} if text is not None else {"role": "assistant"}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 3}}
REPLIES = {
    "ok": (200, sse(chunk(), chunk("a"), chunk("b"), chunk("c"), chunk(None, "length"), USAGE,
                    "[DONE]")),
    "busy": (503, b'{"error": {"message": "too many requests"}}'),
    "failed": (200, sse(chunk("a"), {"error": {"message": "generation failed: boom"}}, "[DONE]")),
    "cut": (200, sse(chunk("a"), chunk("b"))),
}


def scripted_send(kind: str) -> RequestRecord:
    status, body = REPLIES[kind]
    seen = {}

    def reply(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(status, content=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as client:
            target = load_client.ChatTarget("http://server")
            return await load_client.send_chat(client, target, RequestSpec(3, "hi there", 2, 3))

    out = asyncio.run(go())
    assert seen["max_tokens"] == 3 and seen["ignore_eos"] is True and seen["stream"] is True
    assert seen["stream_options"] == {"include_usage": True}
    return out


def test_the_client_times_content_chunks_and_reads_usage():
    r = scripted_send("ok")
    assert r.ok and len(r.chunk_times) == 3      # the role-only chunk is not a token
    assert (r.prompt_tokens, r.completion_tokens, r.asked_tokens) == (30, 3, 3)
    assert r.sent <= r.chunk_times[0] <= r.ended


@pytest.mark.parametrize("kind, error", [("busy", "http_503"), ("failed", "stream_error"),
                                         ("cut", "incomplete")])
def test_the_client_names_each_kind_of_failure(kind, error):
    r = scripted_send(kind)
    assert r.error == error and r.ended is not None and r.detail


# ---- the table ---------------------------------------------------------------------------------

def test_the_table_puts_the_servers_side_by_side_with_their_ratio():
    fast = load_stats.summarize([record(0.0, [0.1, 0.2, 0.3], tokens=3, asked=3)], 1.0, 1.0)
    slow = load_stats.summarize([record(0.0, [0.2, 0.4, 0.6], tokens=3, asked=3),
                                 record(0.0, [], error="http_503")], 1.0, 1.0)
    results = {"freetoken": {"levels": {"concurrency 1": fast}},
               "llama-server": {"levels": {"concurrency 1": slow}}}
    table = load_report.level_table("concurrency 1", "head", results,
                                    {"freetoken": "FreeToken", "llama-server": "llama-server"})
    rows = {line[:22].strip(): line[22:].split() for line in table.splitlines()[2:]}
    assert rows["completed"] == ["1/1", "1/2"]
    assert rows["TTFT p50 ms"] == ["100.0", "200.0", "0.50x"]
    assert rows["output tok/s"][2] == f"{fast['output_tok_per_s'] / slow['output_tok_per_s']:.2f}x"
    assert rows["errors"] == ["none", "http_503", "1"]
    alone = load_report.level_table("concurrency 1", "head",
                                    {"freetoken": results["freetoken"],
                                     "llama-server": {"unavailable": "not built"}},
                                    {"freetoken": "FreeToken", "llama-server": "llama-server"})
    assert "x" not in alone.splitlines()[3] and "not built" in alone


def test_the_command_line():
    args = serve_load.parse_args(["--concurrency", "1,4,16", "--servers",
                                  "llama-server,freetoken", "--prompt-len", "64-256"])
    assert args.concurrency == [1, 4, 16] and args.max_num_seqs == 16
    assert args.servers == ["freetoken", "llama-server"]          # FreeToken first: the ratio
    assert str(args.prompt_len) == "64-256" and str(args.output_len) == "64"
    rates = serve_load.parse_args(["--rates", "0.5,inf"])
    assert rates.rates == [0.5, float("inf")] and rates.max_num_seqs == 16
    for bad in (["--rates", "1", "--concurrency", "2"], ["--concurrency", "1.5"],
                ["--rates", "0"], ["--rates", "1", "--servers", "vllm"],
                ["--rates", "1", "--output-len", "0"]):
        with pytest.raises(SystemExit):
            serve_load.parse_args(bad)


# ---- the servers -------------------------------------------------------------------------------

class FakeLlamaServer:
    """llama_tools.LlamaServer's surface: dies warming up unless started with repack=False."""

    started: list = []

    def __init__(self, model, threads, ctx, gpu, parallel, binary, repack):
        self.port, self.repack, self.closed = 4000 + len(self.started), repack, False
        self.started.append(self)

    def wait_ready(self):
        if self.repack:
            raise llama_tools.ToolUnavailable("llama-server exited (-4): warming up ...")
        return {"start_to_ready_s": 0.5}

    def close(self):
        self.closed = True
        return 100.0


def test_a_llama_server_that_dies_over_repacked_weights_starts_again_without(monkeypatch,
                                                                             tmp_path):
    monkeypatch.setattr(llama_tools, "LlamaServer", FakeLlamaServer)
    FakeLlamaServer.started = []
    plan = load_servers.ServerPlan(tmp_path / "m.gguf", "cpu", 2, 4, 200, 8)
    server, ready = load_servers.start_server("llama-server", plan)
    first, second = FakeLlamaServer.started
    assert first.repack and first.closed and not second.repack
    assert server.base_url == "http://127.0.0.1:4001"
    assert ready["note"] == ("--no-repack (llama-server exited (-4) with weights repacked "
                             "at load)")
    from benchmarks.llama_cpp_cuda import paths

    monkeypatch.setattr(paths, "tool", lambda name: tmp_path / name)
    FakeLlamaServer.started = []
    with pytest.raises(load_servers.ServerUnavailable, match="exited"):   # a GPU: no retry
        load_servers.start_server("llama-server", load_servers.ServerPlan(
            tmp_path / "m.gguf", "cuda", 2, 4, 200, 8))
    assert len(FakeLlamaServer.started) == 1


def test_a_missing_llama_server_leaves_its_column_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    plan = load_servers.ServerPlan(tmp_path / "m.gguf", "cpu", 2, 4, 200, 8)
    with pytest.raises(load_servers.ServerUnavailable, match="build_llama_cpp.sh"):
        load_servers.start_server("llama-server", plan)


# ---- a real run --------------------------------------------------------------------------------

@pytest.mark.needs_weights
def test_a_short_run_against_ft_serve_completes_every_request(tmp_path, capsys):
    out = tmp_path / "load.json"
    report = serve_load.main(["--concurrency", "2", "--num-requests", "6", "--prompt-len", "16",
                              "--output-len", "4-8", "--servers", "freetoken", "--threads", "2",
                              "--results", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    server = report["servers"]["freetoken"]
    assert "unavailable" not in server and server["warmup_error"] is None
    level = server["levels"]["concurrency 2"]
    assert (level["requests"], level["completed"], level["errors"]) == (6, 6, {})
    assert level["short_outputs"] == 0                 # ignore_eos: every reply is full length
    assert 6 * 4 <= level["output_tokens"] <= 6 * 8
    assert level["mean_prompt_tokens"] > 16           # the user message and the template
    assert level["ttft_s"]["p50"] > 0 and level["tpot_s"]["p99"] > 0
    assert level["output_tok_per_s"] == pytest.approx(level["output_tokens"]
                                                      / level["duration_s"])
    assert "concurrency 2: 6 requests" in capsys.readouterr().out


@pytest.mark.needs_weights
def test_a_short_run_against_llama_server_where_it_is_built(tmp_path):
    try:
        llama_tools.tool("llama-server")
    except llama_tools.ToolUnavailable as exc:
        pytest.skip(str(exc))
    report = serve_load.main(["--concurrency", "2", "--num-requests", "4", "--prompt-len", "16",
                              "--output-len", "4", "--servers", "llama-server", "--threads",
                              "2"])
    server = report["servers"]["llama-server"]
    assert "unavailable" not in server and server["warmup_error"] is None
    level = server["levels"]["concurrency 2"]
    assert (level["completed"], level["errors"], level["short_outputs"]) == (4, {}, 0)
    assert level["output_tokens"] == 4 * 4                 # its usage: ignore_eos honoured
    assert level["mean_prompt_tokens"] > 16 and level["tpot_s"]["p50"] > 0
