"""CPU serving side by side: FreeToken, llama.cpp (its own llama-bench and llama-server, and
llama-cpp-python) and HF transformers.

One run on this machine: the embedded SmolLM2-135M-Instruct Q4_1 GGUF, greedy, the same token
ids for every peer, each peer in its own process. Per peer: prompt tok/s (~42 and ~520 tokens),
time to first token (42-token prompt), decode tok/s at batch 1, start->ready (spawn until a
request is answerable, warm-up included), load+warm-up (in-process, imports excluded), peak RSS.
FreeToken runs in-process (its engine) and as `ft serve` (until /health is 200, then
non-streamed completions over HTTP). The peers stay loaded side by side and each round visits
every one in turn (llama-bench runs one repetition per round), so load from other work on a
shared machine hits all alike; min / median / max over the rounds. Like is compared with like:
prompt and decode speed with llama-bench, start->ready of `ft serve` with llama-server's and
of the in-process engine with llama-cpp-python's. llama.cpp runs with flash attention on.

    python benchmarks/cpu_serve.py [--threads 2] [--repeats 5] [--skip llama_cpp,transformers]

llama-bench and llama-server: benchmarks/build_llama_cpp.sh (the llama.cpp that
llama-cpp-python 0.3.36 vendors; skipped when not built). llama-cpp-python: `pip install
llama-cpp-python==0.3.36` (builds from source). transformers runs float32 weights dequantized
from the same GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llama_tools import LlamaServer, ToolUnavailable, bench_round, stop_and_peak_rss_mb, tool

REQUEST_PEERS = ("freetoken", "ft_serve", "llama_cpp", "transformers")
PEERS = REQUEST_PEERS + ("llama_bench", "llama_server")
LABELS = {"freetoken": "FreeToken (engine, in-process)", "ft_serve": "FreeToken (ft serve, HTTP)",
          "llama_cpp": "llama.cpp (llama-cpp-python)", "transformers": "HF transformers fp32",
          "llama_bench": "llama.cpp (llama-bench)", "llama_server": "llama.cpp (llama-server)"}
REFERENCE = ("Reference, 2-vCPU Sapphire Rapids (not this machine): llama.cpp decode 120 tok/s, "
             "transformers 31.5 tok/s; start->ready 0.21 s / 14.2 s")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
        "lantern, a notebook and a thermos of strong tea. From the gallery he could see the "
        "fishing boats return, the gulls settle on the harbour wall and the first stars appear "
        "over the headland. He wrote down the wind, the swell and the names of the ships. ")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _spread(values: list[float]) -> dict:
    """min / median / max of a metric's samples over the rounds."""
    if not values:
        return {"min": None, "median": None, "max": None, "samples": []}
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "samples": values}


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (package missing, process died); the message says why."""


UNAVAILABLE = (PeerUnavailable, ToolUnavailable)


PEER_SCRIPT = Path(__file__).with_name("cpu_serve_peers.py")


# ---- the parent: peers as live processes, measured in turns ---------------------------------

class Worker:
    """One peer in a worker process, kept loaded until close()."""

    def __init__(self, peer: str, spec: dict):
        self.peer = peer
        self._log = tempfile.TemporaryFile("w+")   # a file: a full pipe would block the peer
        self.spawned = time.time()
        self._proc = subprocess.Popen([sys.executable, str(PEER_SCRIPT), peer,
                                       json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)

    def wait_ready(self) -> dict:
        """{start_to_ready_s, load_warm_s}; raises PeerUnavailable."""
        info = self._expect("ready")
        return {"start_to_ready_s": info["wall"] - self.spawned,
                "load_warm_s": info["load_warm_s"]}

    def first_token_s(self, ids: list[int]) -> float:
        return self._request(ids, 1)[0]

    def decode_tok_s(self, ids: list[int], n: int) -> float:
        stamps = self._request(ids, n)
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def close(self) -> float:
        """Stop the process; its peak RSS in MB."""
        try:
            self._proc.stdin.write("null\n")
            self._proc.stdin.flush()
            return self._expect("rss")
        finally:
            self._proc.wait(timeout=60)
            self._log.close()

    def _request(self, ids: list[int], n: int) -> list[float]:
        self._proc.stdin.write(json.dumps({"ids": ids, "n": n}) + "\n")
        self._proc.stdin.flush()
        return self._expect("stamps")

    def _expect(self, kind: str):
        for line in self._proc.stdout:
            if line.startswith("@@"):
                got, payload = line[2:].split(" ", 1)
                if got == "unavailable":
                    raise PeerUnavailable(json.loads(payload))
                if got == kind:
                    return json.loads(payload)
        self._log.seek(0)
        tail = " | ".join(self._log.read().strip().splitlines()[-4:])
        raise PeerUnavailable(f"the {self.peer} worker exited ({self._proc.wait()}): {tail}")


class ServeWorker:
    """`ft serve` as a subprocess, measured through non-streamed HTTP completions."""

    def __init__(self, spec: dict):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [str(Path(sys.executable).with_name("ft")), "serve", "--port", str(self.port),
                   "--device", "cpu", "--log-level", "warning", "--num-tokens", "4096",
                   "--no-prefix-cache"]   # repeated prompts: measure prefill, not the cache
        if spec["model_arg"]:
            command += ["--model", spec["model"]]
        self._log = tempfile.TemporaryFile("w+")
        self.spawned = time.perf_counter()
        self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._log)

    def wait_ready(self) -> dict:
        while True:
            if self._proc.poll() is not None:
                self._log.seek(0)
                raise PeerUnavailable("ft serve exited: " + self._log.read()[-400:])
            try:
                _http(self.base + "/health", timeout=1.0)
                return {"start_to_ready_s": time.perf_counter() - self.spawned}
            except OSError:
                time.sleep(0.01)

    def first_token_s(self, ids: list[int]) -> float:
        return self._seconds(ids, 1)

    def decode_tok_s(self, ids: list[int], n: int) -> float:
        """From the extra time of an n-token request over a 1-token one (same prompt)."""
        first = self._seconds(ids, 1)
        return (n - 1) / (self._seconds(ids, n) - first)

    def close(self) -> float:
        """Stop the server; its peak RSS in MB."""
        return stop_and_peak_rss_mb(self._proc, self._log)

    def _seconds(self, ids: list[int], n: int) -> float:
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        _http(self.base + "/v1/completions", body)
        return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def open_peer(peer: str, spec: dict):
    if peer == "llama_server":
        return LlamaServer(spec["model"], spec["threads"])
    return ServeWorker(spec) if peer == "ft_serve" else Worker(peer, spec)


def measure_rounds(live: dict, spec: dict, with_bench: bool) -> dict[str, dict]:
    """Every round visits each live peer in turn, then llama-bench for one repetition."""
    peers = list(live) + (["llama_bench"] if with_bench else [])
    samples = {peer: {"ttft": [], "decode": [], **{n: [] for n in spec["prompts"]}}
               for peer in peers}
    ids42 = spec["prompts"]["42"]
    for round_ in range(spec["repeats"]):
        print(f"round {round_ + 1}/{spec['repeats']} ...", file=sys.stderr, flush=True)
        for peer, proc in live.items():
            got = samples[peer]
            for name, ids in spec["prompts"].items():
                got[name].append(len(ids) / proc.first_token_s(ids))
            got["ttft"].append(proc.first_token_s(ids42))
            got["decode"].append(proc.decode_tok_s(ids42, spec["gen_tokens"]))
        if with_bench:
            bench = bench_round(spec["model"], spec["threads"],
                                [int(n) for n in spec["prompts"]], spec["gen_tokens"])
            for name in spec["prompts"]:
                samples["llama_bench"][name].append(bench["prompt_tok_s"][name])
            samples["llama_bench"]["decode"].append(bench["decode_tok_s"])
            if bench["prompt_note"]:
                samples["llama_bench"]["note"] = bench["prompt_note"]
    notes = {peer: {"note": got["note"]} for peer, got in samples.items() if "note" in got}
    return {peer: {"prompt_tok_s": {n: _spread(got[n]) for n in spec["prompts"]},
                   "ttft_s": _spread(got["ttft"]), "decode_tok_s": _spread(got["decode"]),
                   **notes.get(peer, {})}
            for peer, got in samples.items()}



def extra_starts(peers: list[str], spec: dict, repeats: int) -> dict[str, list[dict]]:
    """More spawn-until-ready samples, peers in turn (transformers once: ~15 s a start)."""
    starts: dict[str, list[dict]] = {peer: [] for peer in peers}
    for _ in range(max(0, repeats - 1)):
        for peer in peers:
            if peer == "transformers":
                continue
            proc = open_peer(peer, {**spec, "prompts": {"42": spec["prompts"]["42"]}})
            try:
                starts[peer].append(proc.wait_ready())
            finally:
                proc.close()
    return starts


# ---- report ---------------------------------------------------------------------------------

def prompts_for(model: Path, lengths: tuple[int, ...]) -> dict[str, list[int]]:
    """Token ids of TEXT (repeated as needed), cut to each length."""
    from freetoken.models.checkpoint.gguf_file import GGUFFile
    from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(GGUFFile(model).meta, str(model))
    ids = tokenizer.encode(TEXT * (1 + max(lengths) // 40))
    return {str(n): ids[:n] for n in lengths}


def import_torch_seconds(repeats: int) -> float:
    """Median seconds from spawning Python until `import torch` returns (exit not counted):
    what the CPU path saves by never importing torch (transformers' floor)."""
    def once() -> float:
        spawned = time.time()
        out = subprocess.run([sys.executable, "-c", "import time, torch; print(time.time())"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[-1]) - spawned

    return _median([once() for _ in range(repeats)])


def machine_line() -> str:
    info = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
                 if ln.startswith("model name")), "unknown CPU")
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{name}, {os.cpu_count()} CPUs, {isa}, load average {os.getloadavg()[0]:.1f}"


def _med(result: dict, key: str):
    value = result.get(key)
    return value.get("median") if isinstance(value, dict) else value


def _cell(result: dict, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """median [min-max] of a metric (or its single value), '-' when not measured."""
    value = result.get(key)
    if value is None or (isinstance(value, dict) and value["median"] is None):
        return "-"
    if not isinstance(value, dict):
        return fmt.format(value * scale)
    return (f"{fmt.format(value['median'] * scale)} [{fmt.format(value['min'] * scale)}-"
            f"{fmt.format(value['max'] * scale)}]")


def print_table(results: dict[str, dict], spec: dict) -> None:
    names = list(spec["prompts"])
    columns = [f"prompt{n} tok/s" for n in names] + ["TTFT ms", "decode tok/s", "ready s",
                                                     "load s", "RSS MB"]
    print(f"{'peer':32} " + " | ".join(columns))
    for peer, r in results.items():
        if "unavailable" in r:
            print(f"{LABELS[peer]:32} unavailable: {r['unavailable']}")
            continue
        rates = r.get("prompt_tok_s", {})
        cells = [_cell(rates, n, 1, "{:.0f}") for n in names]
        cells += [_cell(r, "ttft_s", 1e3), _cell(r, "decode_tok_s"),
                  _cell(r, "start_to_ready_s", 1, "{:.2f}"), _cell(r, "load_warm_s", 1, "{:.2f}"),
                  _cell(r, "peak_rss_mb", 1, "{:.0f}")]
        print(f"{LABELS[peer]:32} " + " | ".join(cells))
    print(f"median [min-max] over {spec['repeats']} interleaved rounds (start->ready over "
          f"{spec['start_repeats']} spawns); decode: batch 1, {spec['gen_tokens']} tokens, "
          "greedy; ready: spawn until answerable; load: load + warm-up in-process; llama.cpp "
          "with flash attention on")


def _ratio(ours: dict, other: dict, key: str, inverse: bool = False) -> str | None:
    a, b = _med(ours, key), _med(other, key)
    if a is None or b is None:
        return None
    return f"x{(b / a) if inverse else (a / b):.2f}"


def print_ratios(results: dict[str, dict]) -> None:
    """Like with like: speeds against llama-bench (and the binding), starts server/server and
    in-process/in-process. >1 = FreeToken better."""
    ours, serve = results.get("freetoken", {}), results.get("ft_serve", {})
    for peer in ("llama_bench", "llama_cpp", "transformers"):
        other = results.get(peer, {})
        if "unavailable" in other or _med(other, "decode_tok_s") is None or not ours:
            continue
        parts = [f"decode {_ratio(ours, other, 'decode_tok_s')}"]
        for n in ours.get("prompt_tok_s", {}):
            parts.append(f"prompt{n} {_ratio(ours['prompt_tok_s'], other['prompt_tok_s'], n)}")
        if _med(other, "ttft_s") is not None:
            parts.append(f"TTFT {_ratio(ours, other, 'ttft_s', inverse=True)}")
        if peer != "llama_bench" and _med(other, "start_to_ready_s") is not None:
            parts.append(f"start->ready in-process "
                         f"{_ratio(ours, other, 'start_to_ready_s', inverse=True)}, load+warm-up "
                         f"{_ratio(ours, other, 'load_warm_s', inverse=True)}")
        print(f"FreeToken vs {LABELS[peer]}: " + ", ".join(parts))
        if other.get("note"):
            print(f"  ({LABELS[peer]}: {other['note']})")
    server = results.get("llama_server", {})
    if serve and "unavailable" not in serve and _med(server, "start_to_ready_s") is not None:
        print(f"ft serve vs llama-server: start->ready {_med(serve, 'start_to_ready_s'):.2f} s vs "
              f"{_med(server, 'start_to_ready_s'):.2f} s "
              f"({_ratio(serve, server, 'start_to_ready_s', inverse=True)}), peak RSS "
              f"{_med(serve, 'peak_rss_mb'):.0f} MB vs {_med(server, 'peak_rss_mb'):.0f} MB")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file (default: embedded SmolLM2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--start-repeats", type=int, default=5,
                        help="spawns for the start->ready median (transformers: 1)")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--prompt-lens", default="42,520")
    parser.add_argument("--skip", default="", help=f"comma-separated, from {','.join(PEERS)}")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.skip.split(","))) - set(PEERS)
    if unknown:
        parser.error(f"--skip: unknown peer(s) {', '.join(sorted(unknown))}; known: "
                     f"{', '.join(PEERS)}")
    if "42" not in args.prompt_lens.split(","):
        parser.error("--prompt-lens must include 42 (the TTFT and decode prompt)")
    return args


def run_all(peers: list[str], spec: dict, start_repeats: int) -> dict[str, dict]:
    """Start each peer alone (start->ready), measure them in rounds, stop them (peak RSS),
    then spawn each again for more start->ready samples."""
    results: dict[str, dict] = {}
    live = {}
    for peer in peers:
        if peer == "llama_bench":
            try:
                tool("llama-bench")
                results[peer] = {}
            except ToolUnavailable as exc:
                results[peer] = {"unavailable": str(exc)}
            continue
        print(f"starting {LABELS[peer]} ...", file=sys.stderr, flush=True)
        try:
            proc = open_peer(peer, spec)
            results[peer] = {k: [v] for k, v in proc.wait_ready().items()}
            live[peer] = proc
        except UNAVAILABLE as exc:
            results[peer] = {"unavailable": str(exc)}
    requests = {p: proc for p, proc in live.items() if p != "llama_server"}
    try:
        measured = measure_rounds(requests, spec, "unavailable" not in results.get(
            "llama_bench", {"unavailable": "skipped"}))
        for peer, values in measured.items():
            results[peer].update(values)
    finally:
        for peer, proc in live.items():
            results[peer]["peak_rss_mb"] = proc.close()
    for peer, samples in extra_starts(list(live), spec, start_repeats).items():
        for key in ("start_to_ready_s", "load_warm_s"):
            if key in results[peer]:
                results[peer][key] = _spread(results[peer][key] + [s[key] for s in samples])
    return results


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from freetoken.models.checkpoint.default import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    lengths = tuple(int(n) for n in args.prompt_lens.split(","))
    spec = {"model": str(model), "model_arg": args.model is not None, "threads": args.threads,
            "repeats": args.repeats, "gen_tokens": args.gen_tokens,
            "start_repeats": args.start_repeats,
            "prompts": prompts_for(model, lengths)}
    os.environ.setdefault("FREETOKEN_NUM_THREADS", str(args.threads))
    peers = [p for p in PEERS if p not in set(args.skip.split(","))]
    print(machine_line(), flush=True)
    if "freetoken" in peers or "ft_serve" in peers:   # a first run may compile the kernels
        primer = Worker("freetoken", spec)
        primer.wait_ready()
        primer.close()
    results = run_all(peers, spec, args.start_repeats)
    floor = import_torch_seconds(max(1, args.start_repeats))
    print(f"load average after: {os.getloadavg()[0]:.1f}; spawning Python + `import torch` alone "
          f"takes {floor:.2f} s (median); FreeToken's CPU path never imports it")
    print_table(results, spec)
    print_ratios(results)
    print(REFERENCE)
    if args.json_path:
        spec.pop("prompts")
        Path(args.json_path).write_text(json.dumps({"machine": machine_line(), "spec": spec,
                                                    "import_torch_s": floor,
                                                    "results": results}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
