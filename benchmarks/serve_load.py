"""Serving under load: the same open- or closed-loop load of streamed OpenAI chat requests
against `ft serve` and llama.cpp's `llama-server` on the same GGUF, one server after the other,
printed side by side per rate or concurrency.

    python benchmarks/serve_load.py --concurrency 1,4,16 --prompt-len 128 --output-len 64 \\
        --results benchmarks/results/cpu-serve_load-smollm2.json
    python benchmarks/serve_load.py --rates 1,2,4,inf --num-requests 64 --device cuda --model Q.gguf

Load: `--rates` sends requests at Poisson arrival times of each rate (seeded; `inf`: all at
once), whatever the server's pace; `--concurrency` keeps that many streams busy (closed loop).
A level sends `--num-requests` (default: 32 per rate, 4 per stream and at least 16 per
concurrency) or stops sending after `--duration` seconds. Prompt and output lengths: N,
LO-HI (uniform) or normal:MEAN,STD, drawn from `--seed`; every request asks for exactly its
output length (`max_tokens` + `ignore_eos`). Per level and server: requests/s, output tok/s,
TTFT / TPOT / ITL p50/p90/p99, goodput under `--ttft-slo-ms` / `--tpot-slo-ms`, errors by kind.

Both servers get the same budget (benchmarks/load_servers.py): `--max-num-seqs` sequences at
once (llama-server: `-np` slots with continuous batching) and a KV of that many times the
longest request. llama-server comes from benchmarks/build_llama_cpp.sh on the CPU and from
`python -m benchmarks.llama_cpp_cuda build` with `--device cuda`; without it, its column says
so and FreeToken's runs. On a CPU where it dies warming up over weights repacked at load
(ggml's AMX matmul on some CPUs), it starts again with `--no-repack`, and the output says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# appended, not first: the repository's kernels/ folder must not shadow an installed `kernels`
sys.path.append(str(REPO))

from benchmarks import load_client, load_report, load_stats  # noqa: E402
from benchmarks.load_servers import SERVERS, ServerPlan, ServerUnavailable, start_server  # noqa: E402
from benchmarks.load_workload import (LengthDistribution, PromptWriter, RequestSpec,  # noqa: E402
                                      WorkloadError, arrival_times, draw_requests)

WARMUP_TOKENS = 8


def parse_levels(text: str, integer: bool) -> list[float]:
    values = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        value = float(part)
        if integer and (value != int(value) or value < 1):
            raise argparse.ArgumentTypeError(f"{part}: a concurrency is a whole number >= 1")
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{part}: a rate is > 0 (or inf)")
        values.append(int(value) if integer else value)
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def parse_length(text: str) -> LengthDistribution:
    try:
        return LengthDistribution.parse(text)
    except WorkloadError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rates", type=lambda t: parse_levels(t, False),
                      help="requests/s of each open-loop level, e.g. 1,2,4,inf")
    load.add_argument("--concurrency", type=lambda t: parse_levels(t, True),
                      help="streams of each closed-loop level, e.g. 1,4,16")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                        help="stop sending after this long per level")
    parser.add_argument("--prompt-len", type=parse_length, default="128")
    parser.add_argument("--output-len", type=parse_length, default="64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, from {','.join(SERVERS)}")
    parser.add_argument("--model", default=None,
                        help="a GGUF file or ORG/NAME[:QUANT] (default: the embedded SmolLM2)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="FreeToken's --max-num-seqs = llama-server's -np (default: the "
                             "largest concurrency, else 16)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--results", default=None, metavar="FILE", help="write the JSON here")
    args = parser.parse_args(argv)
    servers = [s for s in filter(None, args.servers.split(","))]
    unknown = set(servers) - set(SERVERS)
    if unknown or not servers:
        parser.error(f"--servers: unknown {sorted(unknown)}; known: {', '.join(SERVERS)}")
    args.servers = [s for s in SERVERS if s in servers]       # FreeToken first: the ratio
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.concurrency) if args.concurrency else 16
    return args


def model_path(argument: str | None) -> Path:
    """The GGUF file both servers load: the embedded model's, or --model resolved as `ft
    serve` resolves it (an existing path wins over ORG/NAME)."""
    if argument is None:
        from freetoken.models.checkpoint.default import default_model_path

        return default_model_path()
    from freetoken.models.resolve import resolve_model

    path = Path(resolve_model(argument).path)
    if path.suffix != ".gguf":
        raise SystemExit(f"--model {argument}: {path} is not a GGUF file; llama-server needs one")
    return path


def plan_levels(args: argparse.Namespace, writer: PromptWriter) -> list[dict]:
    """Every level's name, requests and (open loop) arrival times, drawn before any server
    starts: the same for each server."""
    levels = []
    for i, value in enumerate(args.rates or args.concurrency):
        if args.rates:
            default = 32 if math.isinf(value) or args.duration is None else math.ceil(
                value * args.duration)
            name = f"rate {value:g}/s"
        else:
            default, name = max(16, 4 * value), f"concurrency {value}"
        count = args.num_requests or default
        specs = draw_requests(count, args.prompt_len, args.output_len, writer, args.seed + i)
        arrivals = arrival_times(value, count, args.seed + i) if args.rates else None
        levels.append({"name": name, "value": value, "specs": specs, "arrivals": arrivals})
    return levels


def run_level(target: load_client.ChatTarget, level: dict, duration: float | None):
    if level["arrivals"] is not None:
        return asyncio.run(load_client.run_open_loop(target, level["specs"], level["arrivals"],
                                                     duration))
    return asyncio.run(load_client.run_closed_loop(target, level["specs"], level["value"],
                                                   duration))


def run_server(name: str, plan: ServerPlan, levels: list[dict], args) -> dict:
    """Start one server, warm it up, run every level, stop it."""
    print(f"starting {SERVERS[name].label} ...", file=sys.stderr, flush=True)
    try:
        server, ready = start_server(name, plan)
    except ServerUnavailable as exc:
        print(f"  unavailable: {exc}", file=sys.stderr, flush=True)
        return {"unavailable": str(exc)}
    out = {**ready, "levels": {}}
    target = load_client.ChatTarget(server.base_url, args.temperature, args.request_timeout)
    try:
        warmup = RequestSpec(-1, levels[0]["specs"][0].prompt, 0, WARMUP_TOKENS)
        out["warmup_error"] = asyncio.run(load_client.run_closed_loop(target, [warmup], 1))[0].error
        for level in levels:
            records = run_level(target, level, args.duration)
            summary = load_stats.summarize(records, _seconds(args.ttft_slo_ms),
                                           _seconds(args.tpot_slo_ms))
            out["levels"][level["name"]] = summary
            print(f"  {level['name']}: {summary['completed']}/{summary['requests']} in "
                  f"{summary['duration_s']:.1f} s, {summary['output_tok_per_s'] or 0:.1f} tok/s, "
                  f"errors {summary['errors'] or 'none'}", file=sys.stderr, flush=True)
    finally:
        out["peak_rss_mb"] = server.close()
    return out


def _seconds(ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else ms / 1e3


def machine_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    return f"{name}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    model = model_path(args.model)
    try:
        levels = plan_levels(args, PromptWriter(model))
    except WorkloadError as exc:
        raise SystemExit(f"serve_load: {exc}") from None
    longest = max(s.prompt_tokens + s.output_tokens for lv in levels for s in lv["specs"])
    queued = max(len(lv["specs"]) for lv in levels) + 8 * args.max_num_seqs
    plan = ServerPlan(model, args.device, args.threads, args.max_num_seqs, longest, queued)
    print(machine_line(), flush=True)
    print(f"model {model.name}; prompt {args.prompt_len}, output {args.output_len} tokens; "
          f"max-num-seqs {plan.max_num_seqs}, KV {plan.kv_tokens} tokens "
          f"({plan.slot_tokens} a sequence); {args.threads} threads; seed {args.seed}", flush=True)
    results = {name: run_server(name, plan, levels, args) for name in args.servers}
    labels = {name: SERVERS[name].label for name in args.servers}
    for level in levels:
        header = (f"\n{level['name']}: {len(level['specs'])} requests"
                  + (f", at most {args.duration:g} s" if args.duration else ""))
        print(load_report.level_table(level["name"], header, results, labels))
    print(load_report.legend(args.ttft_slo_ms, args.tpot_slo_ms))
    for name, result in results.items():
        if "start_to_ready_s" in result:
            print(f"{labels[name]}: start->ready {result['start_to_ready_s']:.2f} s, peak RSS "
                  f"{result['peak_rss_mb']:.0f} MB"
                  + (f"; {result['note']}" if result.get("note") else ""))
    report = {"machine": machine_line(), "command": "python benchmarks/serve_load.py "
              + " ".join(argv), "model": str(model),
              "plan": {"max_num_seqs": plan.max_num_seqs, "kv_tokens": plan.kv_tokens,
                       "slot_tokens": plan.slot_tokens, "threads": plan.threads,
                       "device": plan.device, "queued": plan.queued},
              "load": {"prompt_len": str(args.prompt_len), "output_len": str(args.output_len),
                       "seed": args.seed, "ttft_slo_ms": args.ttft_slo_ms,
                       "tpot_slo_ms": args.tpot_slo_ms, "duration_s": args.duration,
                       "levels": [lv["name"] for lv in levels]},
              "servers": results}
    if args.results:
        path = Path(args.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
