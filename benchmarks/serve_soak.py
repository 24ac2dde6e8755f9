"""Soak test of `ft serve`: mixed requests at a fixed rate for a set time, then checks that the
server accounted for every one of them and came back to where it started.

    python benchmarks/serve_soak.py --duration 20m --rate 2 --threads 2 \\
        --results benchmarks/results/cpu-serve_soak-smollm2.json
    python benchmarks/serve_soak.py --url http://127.0.0.1:1919 --fault-marker '<<soak-fault>>' \\
        --server-log /tmp/ft-serve.log --duration 5m

Without `--url` it starts `ft serve` on the embedded default model (or `--model`) with
FREETOKEN_FAULT_MARKER set, its log in `--server-log` (default: a temporary file), and stops
it at the end (SIGTERM). Against a running server, `--fault-marker` must be the marker it was
started with ('' sends no faulty requests) and the log is read from `--server-log` if given.

Requests (benchmarks/soak_requests.py, weights from `--mix`): valid chat / completions /
messages requests, streamed or not; invalid ones (wrong JSON types: 400 expected); streams the
client leaves after 0-3 events; requests carrying the fault marker (500 or an error event
expected). Checks at the end (benchmarks/soak_checks.py): outcomes as expected; the client's
tally equals the server's counters (/v1/stats, /metrics); RSS (on a GPU also allocated VRAM,
/v1/stats) within `--rss-tolerance` of its level after the warm-up; no ERROR or traceback in
the log but the injected faults'; /v1/stats idle. Exits 1 naming each failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))   # appended: the repository's kernels/ must not shadow `kernels`

from benchmarks import soak_checks, soak_requests  # noqa: E402
from benchmarks.soak_checks import Check, ServerCounts  # noqa: E402
from benchmarks.soak_probe import Probe  # noqa: E402

DEFAULT_MARKER = "<<soak-fault>>"
PROMPT_TOKENS = 64     # soak prompts are at most 24 words (plus the marker and a template)


def parse_duration(text: str) -> float:
    """Seconds from `90`, `90s`, `20m` or `1h`."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: use a positive N, Ns, Nm or Nh")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("60s"))
    parser.add_argument("--warmup", type=parse_duration, default=None,
                        help="RSS is compared to its level this long after the start "
                             "(default: a quarter of --duration, at most 5m)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s (default 2)")
    parser.add_argument("--mix", default=None,
                        help="KIND=WEIGHT,... of " + ",".join(soak_requests.KINDS))
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="valid requests ask for 1..N tokens")
    parser.add_argument("--cancel-tokens", type=int, default=400,
                        help="what a stream the client leaves asks for")
    parser.add_argument("--fault-marker", default=DEFAULT_MARKER)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--sample-interval", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--idle-timeout", type=float, default=120.0, metavar="SECONDS")
    parser.add_argument("--request-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument("--server-log", default=None, metavar="FILE",
                        help="the server's log: written there when this script starts it, "
                             "read from there with --url")
    parser.add_argument("--results", default=None, metavar="FILE", help="write the JSON here")
    started = parser.add_argument_group("the server this script starts (without --url)")
    started.add_argument("--model", default=None, help="a GGUF file or ORG/NAME[:QUANT]")
    started.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    started.add_argument("--threads", type=int, default=None)
    started.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.max_tokens < 1 or args.cancel_tokens < 4:
        parser.error("--rate > 0, --max-tokens >= 1 and --cancel-tokens >= 4")
    try:
        args.mix = soak_requests.parse_mix(args.mix)
    except ValueError as exc:
        parser.error(str(exc))
    if args.warmup is None:
        args.warmup = min(args.duration / 4, 300.0)
    return args


# ---- the server --------------------------------------------------------------------------------

def start_server(args, log) -> tuple[object, str]:
    """`ft serve` with the fault marker set, sized for the soak's longest request; its output
    goes to `log`."""
    import os

    from benchmarks.load_servers import FreeTokenServer, ServerPlan
    from benchmarks.serve_load import model_path

    longest = PROMPT_TOKENS + max(args.max_tokens, args.cancel_tokens)
    plan = ServerPlan(model_path(args.model), args.device, args.threads or os.cpu_count() or 1,
                      args.max_num_seqs, longest, 8 * args.max_num_seqs)
    env = {"FREETOKEN_FAULT_MARKER": args.fault_marker} if args.fault_marker else {}
    server = FreeTokenServer(plan, env=env, log=log)
    try:
        ready = server.wait_ready()
    except BaseException:
        server.close()
        raise
    print(f"started ft serve at {server.base_url} in {ready['start_to_ready_s']:.1f} s "
          f"({plan.model.name}, max-num-seqs {plan.max_num_seqs}, KV {plan.kv_tokens} tokens)",
          flush=True)
    return server, server.base_url


# ---- the run -----------------------------------------------------------------------------------

async def send_all(client, url: str, args) -> list:
    """Requests at `--rate` per second for `--duration`; every reply awaited."""
    rng, tasks, start = random.Random(args.seed), [], time.perf_counter()
    marker = args.fault_marker or None
    for index in range(int(args.duration * args.rate) + 1):
        at = index / args.rate
        if at >= args.duration:
            break
        request = soak_requests.draw_request(index, rng, args.mix, args.max_tokens,
                                             args.cancel_tokens, marker)
        if (delay := start + at - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(soak_requests.send(client, url, request)))
    return list(await asyncio.gather(*tasks))


async def settled_delta(probe: Probe, outcomes: list, before: ServerCounts | None):
    """What the server's counters moved by, read again for up to 10 s while they disagree
    with the client's tally."""
    end = time.monotonic() + 10
    while True:
        now = await probe.counts()
        delta = now.minus(before) if now and before else None
        if delta is None or soak_checks.check_counts(outcomes, delta).ok \
                or time.monotonic() > end:
            return delta
        # NOTE: a response is counted once its handler returns, which for a stream the
        # client left can trail the engine's abort by a moment
        await asyncio.sleep(0.2)


async def run(url: str, args) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        probe = Probe(client, url)
        await probe.start()
        filled = await probe.fill_kv_pool(random.Random(args.seed + 1))
        stats0, before = await probe.stats(), await probe.counts()
        samples, stop, start = [], asyncio.Event(), time.perf_counter()
        watch = asyncio.create_task(probe.watch(start, args.sample_interval, samples, stop))
        outcomes = await send_all(client, url, args)
        stop.set()
        await watch
        idle = await probe.wait_idle(args.idle_timeout)
        final = await probe.sample(start)
        delta = await settled_delta(probe, outcomes, before)
    return {"kv_fill_requests": filled, "stats_before": stats0, "outcomes": outcomes,
            "samples": samples, "final": final, "idle": idle, "delta": delta,
            "seconds": time.perf_counter() - start}


def baseline(samples: list[dict], warmup: float) -> dict:
    """The first sample after the warm-up (the last one when the run was shorter)."""
    return next((s for s in samples if s["t"] >= warmup), samples[-1])


def checks(result: dict, log_text: str | None, args) -> list[Check]:
    outcomes, samples, final = result["outcomes"], result["samples"], result["final"]
    base = result["baseline"] = baseline(samples, args.warmup) if samples else final
    return [soak_checks.check_expected(outcomes),
            soak_checks.check_counts(outcomes, result["delta"]),
            soak_checks.check_growth("rss", base["rss"], final["rss"], args.rss_tolerance),
            soak_checks.check_growth("vram", base["vram"], final["vram"], args.rss_tolerance),
            soak_checks.check_log(log_text),
            soak_checks.check_idle(result["idle"])]


def tally_table(outcomes: list) -> str:
    by_kind = {k: Counter() for k in soak_requests.KINDS}
    for o in outcomes:
        by_kind[o.request.kind][o.outcome] += 1
    lines = [f"{'kind':18}" + "".join(f"{o:>11}" for o in soak_requests.OUTCOMES)]
    for kind, counts in by_kind.items():
        if counts:
            lines.append(f"{kind:18}" + "".join(f"{counts[o]:>11}"
                                                for o in soak_requests.OUTCOMES))
    return "\n".join(lines)


def report(result: dict, found: list[Check], args, argv: list[str]) -> dict:
    outcomes = result["outcomes"]
    print(f"\n{len(outcomes)} requests in {result['seconds']:.0f} s "
          f"({args.rate:g}/s for {args.duration:g} s)")
    print(tally_table(outcomes))
    for check in found:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    return {"command": "python benchmarks/serve_soak.py " + " ".join(argv),
            "rate": args.rate, "duration_s": args.duration, "warmup_s": args.warmup,
            "seconds": result["seconds"], "requests": len(outcomes),
            "kv_fill_requests": result["kv_fill_requests"],
            "outcomes": {kind: dict(Counter(o.outcome for o in outcomes
                                            if o.request.kind == kind))
                         for kind in soak_requests.KINDS},
            "unexpected": [{"index": o.request.index, "kind": o.request.kind,
                            "route": o.request.route, "status": o.status, "detail": o.detail}
                           for o in outcomes if not o.expected][:50],
            "server_delta": result["delta"] and {"finished": result["delta"].finished,
                                                 "refused": result["delta"].refused},
            "baseline": result["baseline"], "final": result["final"],
            "samples": result["samples"],
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in found],
            "passed": all(c.ok for c in found)}


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    server, url, log_path = None, args.url, args.server_log
    if url is None:
        log_path = log_path or tempfile.mkstemp(prefix="serve_soak-", suffix=".log")[1]
        server, url = start_server(args, open(log_path, "w"))
    print(f"soak: {args.rate:g} requests/s for {args.duration:g} s against {url} "
          f"(warm-up {args.warmup:g} s, seed {args.seed})", flush=True)
    try:
        result = asyncio.run(run(url.rstrip("/"), args))
    finally:
        if server is not None:
            server.close()
    log_text = Path(log_path).read_text() if log_path else None
    found = checks(result, log_text, args)
    if server is not None:
        code = server.exit_code
        # SIGTERM: 0, or the signal itself when uvicorn re-raises it (143 in a shell)
        found.append(Check("exit", code in (0, -15, 143), f"ft serve exited {code} on SIGTERM"))
    out = report(result, found, args, argv)
    if log_path and args.url is None:
        print(f"server log: {log_path}")
    if args.results:
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    outcome = main(sys.argv[1:])
    if not outcome["passed"]:
        failed = ", ".join(c["name"] for c in outcome["checks"] if not c["ok"])
        sys.exit(f"serve_soak: FAILED ({failed})")
