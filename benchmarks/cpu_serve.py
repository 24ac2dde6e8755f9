"""CPU serving side by side: FreeToken, llama.cpp (llama-cpp-python) and HF transformers.

One run on this machine, the embedded SmolLM2-135M-Instruct Q4_1 GGUF, greedy, the same token
ids for every peer. Per peer, in a fresh process each: prompt tok/s (~42 and ~520 tokens), time
to first token (42-token prompt), decode tok/s at batch 1 (128 tokens), start->ready (process
spawn until a request is answerable, warm-up included), load+warm-up (in-process, imports
excluded) and peak RSS. FreeToken also runs as `ft serve` (spawn until /health is 200, then
non-streamed completions over HTTP). Timings are medians of --repeats.

    python benchmarks/cpu_serve.py [--threads 2] [--repeats 5] [--skip llama_cpp,transformers]
        [--json out.json]

llama.cpp: `pip install llama-cpp-python` (builds from source; loaded with
use_extra_bufts=False). transformers runs float32 weights dequantized from the same GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PEERS = ("freetoken", "ft_serve", "llama_cpp", "transformers")
LABELS = {"freetoken": "FreeToken (engine, in-process)", "ft_serve": "FreeToken (ft serve, HTTP)",
          "llama_cpp": "llama.cpp (llama-cpp-python)", "transformers": "HF transformers fp32"}
REFERENCE = ("Reference, 2-vCPU Sapphire Rapids (not this machine): llama.cpp decode 120 tok/s, "
             "transformers 31.5 tok/s; start->ready 0.21 s / 14.2 s")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
        "lantern, a notebook and a thermos of strong tea. From the gallery he could see the "
        "fishing boats return, the gulls settle on the harbour wall and the first stars appear "
        "over the headland. He wrote down the wind, the swell and the names of the ships. ")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux


def _timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return _median(times)


# ---- workers: each runs in its own process and prints one RESULT line ------------------------

def worker_freetoken(spec: dict) -> dict:
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    load_start = time.perf_counter()
    loaded = load_model(spec["model"], device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, device="cpu",
                                                     max_prefill_tokens=1024)).start()
    engine.warm_up()
    ready = time.time()
    load_s = time.perf_counter() - load_start

    async def run(ids: list[int], max_tokens: int) -> list[float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        stamps, t0 = [], time.perf_counter()
        async for out in engine.generate(ids, params):
            if out.finish_reason == "error":
                raise RuntimeError(out.error)
            stamps += [time.perf_counter() - t0] * len(out.token_ids)
        return stamps

    try:
        result = _measure(spec, lambda ids, n: asyncio.run(run(ids, n)))
    finally:
        engine.shutdown()
    return {**result, "ready_wall": ready, "load_warm_s": load_s}


def worker_llama_cpp(spec: dict) -> dict:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise PeerUnavailable(f"llama-cpp-python is not installed ({exc}); "
                              "`pip install llama-cpp-python` (builds from source)") from None
    load_start = time.perf_counter()
    llm = Llama(model_path=spec["model"], n_threads=spec["threads"],
                n_threads_batch=spec["threads"], n_ctx=2048, n_batch=1024, n_ubatch=1024,
                use_extra_bufts=False, verbose=False, seed=0)

    def run(ids: list[int], max_tokens: int) -> list[float]:
        llm.reset()             # no prefix reuse between runs: every prompt is prefilled
        stamps, t0 = [], time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            del token
            stamps.append(time.perf_counter() - t0)
            if len(stamps) == max_tokens:
                break
        return stamps

    run(spec["prompts"]["42"][:4], 2)   # warm-up: one tiny request
    ready, load_s = time.time(), time.perf_counter() - load_start
    return {**_measure(spec, run), "ready_wall": ready, "load_warm_s": load_s}


def worker_transformers(spec: dict) -> dict:
    import torch

    try:   # imported before the load clock starts, as the other peers' packages are
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401
        from transformers import LlamaForCausalLM  # noqa: F401
    except ImportError as exc:
        raise PeerUnavailable(f"transformers is not installed ({exc}); "
                              "`pip install transformers`") from None
    torch.set_num_threads(spec["threads"])
    load_start = time.perf_counter()
    model = _transformers_model(Path(spec["model"]))

    class Stamps:
        """A generate() streamer that timestamps every new token (the first put is the prompt)."""

        def __init__(self):
            self.t0, self.times, self.prompt_seen = time.perf_counter(), [], False

        def put(self, value):
            if self.prompt_seen:
                self.times.append(time.perf_counter() - self.t0)
            self.prompt_seen = True

        def end(self):
            pass

    def run(ids: list[int], max_tokens: int) -> list[float]:
        stamps = Stamps()
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, streamer=stamps,
                           pad_token_id=0)
        return stamps.times

    run(spec["prompts"]["42"][:4], 2)
    ready, load_s = time.time(), time.perf_counter() - load_start
    return {**_measure(spec, run), "ready_wall": ready, "load_warm_s": load_s}


def _transformers_model(path: Path):
    """float32 model from the GGUF's dequantized tensors (from_pretrained(gguf_file=) needs
    `accelerate`); its parser runs over a plain array view of the file, as in the tests."""
    import gguf
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, value):
            self._array = value.view(np.ndarray)

    gguf.GGUFReader = Reader
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _measure(spec: dict, run) -> dict:
    """Prompt tok/s per prompt length, TTFT and decode tok/s through `run(ids, max_tokens)`,
    which returns each output token's seconds since the request started."""
    repeats, out = spec["repeats"], {"prompt_tok_s": {}}
    for name, ids in spec["prompts"].items():
        seconds = _median([run(ids, 1)[0] for _ in range(repeats)])
        out["prompt_tok_s"][name] = len(ids) / seconds
        if name == "42":
            out["ttft_s"] = seconds
    rates = []
    for _ in range(repeats):
        stamps = run(spec["prompts"]["42"], spec["gen_tokens"])
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    out["decode_tok_s"] = _median(rates)
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


class PeerUnavailable(RuntimeError):
    """A peer's package is missing; the message says how to install it."""


WORKERS = {"freetoken": worker_freetoken, "llama_cpp": worker_llama_cpp,
           "transformers": worker_transformers}


def worker_main(peer: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    try:
        result = WORKERS[peer](spec)
    except PeerUnavailable as exc:
        result = {"unavailable": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)


# ---- the parent: spawns workers and ft serve, prints the table --------------------------------

def spawn_worker(peer: str, spec: dict, start_only: bool = False) -> dict:
    """Run one worker process; start_to_ready_s = its spawn until it could answer."""
    spec = {**spec, "repeats": 0 if start_only else spec["repeats"]}
    if start_only:
        spec["prompts"] = {"42": spec["prompts"]["42"]}
    spawned = time.time()
    proc = subprocess.run([sys.executable, __file__, "--worker", peer, json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"unavailable": f"worker exited {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1][7:])
    if "ready_wall" in result:
        result["start_to_ready_s"] = result.pop("ready_wall") - spawned
    return result


def run_peer(peer: str, spec: dict, start_repeats: int) -> dict:
    """Full measurement in one process, plus start-only spawns for a median start->ready."""
    result = spawn_worker(peer, spec)
    if "unavailable" in result:
        return result
    starts = [result["start_to_ready_s"]]
    loads = [result["load_warm_s"]]
    for _ in range(start_repeats - 1):
        extra = spawn_worker(peer, spec, start_only=True)
        if "start_to_ready_s" in extra:
            starts.append(extra["start_to_ready_s"])
            loads.append(extra["load_warm_s"])
    result["start_to_ready_s"], result["load_warm_s"] = _median(starts), _median(loads)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _peak_rss_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ft_serve_once(spec: dict, measure: bool) -> dict:
    """Spawn `ft serve`, time it until /health is 200; optionally time completions over HTTP."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).with_name("ft")), "serve", "--port", str(port),
               "--device", "cpu", "--log-level", "warning", "--num-tokens", "4096"]
    if spec["model_arg"]:
        command += ["--model", spec["model"]]
    log = tempfile.TemporaryFile("w+")     # a file, not a pipe: nothing blocks on a full pipe
    spawned = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                return {"unavailable": "ft serve exited: " + log.read()[-400:]}
            try:
                _http(base + "/health", timeout=1.0)
                break
            except OSError:
                time.sleep(0.01)
        result = {"start_to_ready_s": time.perf_counter() - spawned}
        if measure:
            result.update(_measure_http(spec, base))
            result["peak_rss_mb"] = _peak_rss_of(proc.pid)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _measure_http(spec: dict, base: str) -> dict:
    """Non-streamed completions: prompt rate and TTFT from 1-token requests, decode rate from
    the extra time of a gen_tokens request over a 1-token one."""
    def seconds(ids: list[int], max_tokens: int) -> float:
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return _timed(lambda: _http(base + "/v1/completions", body), spec["repeats"])

    out = {"prompt_tok_s": {}}
    for name, ids in spec["prompts"].items():
        out["prompt_tok_s"][name] = len(ids) / seconds(ids, 1)
    out["ttft_s"] = seconds(spec["prompts"]["42"], 1)
    n = spec["gen_tokens"]
    out["decode_tok_s"] = (n - 1) / (seconds(spec["prompts"]["42"], n) - out["ttft_s"])
    return out


def run_ft_serve(spec: dict, start_repeats: int) -> dict:
    result = ft_serve_once(spec, measure=True)
    if "unavailable" in result:
        return result
    starts = [result["start_to_ready_s"]]
    starts += [r["start_to_ready_s"] for r in (ft_serve_once(spec, False)
                                               for _ in range(start_repeats - 1))
               if "start_to_ready_s" in r]
    result["start_to_ready_s"] = _median(starts)
    return result


# ---- report ---------------------------------------------------------------------------------

def prompts_for(model: Path, lengths: tuple[int, ...]) -> dict[str, list[int]]:
    """Token ids of TEXT (repeated as needed), cut to each length."""
    from freetoken.models.gguf_file import GGUFFile
    from freetoken.models.gguf_tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(GGUFFile(model).meta, str(model))
    ids = tokenizer.encode(TEXT * (1 + max(lengths) // 40))
    return {str(n): ids[:n] for n in lengths}


def import_torch_seconds(repeats: int) -> float:
    """Median seconds from spawning Python until `import torch` returns (exit not counted):
    the floor of FreeToken's start->ready."""
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


def _cell(result: dict, key: str, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    value = result.get(key)
    if isinstance(value, dict) or value is None:
        return "-"
    return fmt.format(value * scale)


def print_table(results: dict[str, dict], spec: dict) -> None:
    header = (f"{'peer':32} {'prompt42':>9} {'prompt520':>9} {'TTFT ms':>8} {'decode':>8} "
              f"{'ready s':>8} {'load s':>7} {'RSS MB':>7}")
    print(header)
    print("-" * len(header))
    for peer, r in results.items():
        if "unavailable" in r:
            print(f"{LABELS[peer]:32} unavailable: {r['unavailable']}")
            continue
        rates = r.get("prompt_tok_s", {})
        print(f"{LABELS[peer]:32} {rates.get('42', float('nan')):9.0f} "
              f"{rates.get('520', float('nan')):9.0f} {_cell(r, 'ttft_s', 1e3):>8} "
              f"{_cell(r, 'decode_tok_s'):>8} {_cell(r, 'start_to_ready_s', 1, '{:.2f}'):>8} "
              f"{_cell(r, 'load_warm_s', 1, '{:.2f}'):>7} "
              f"{_cell(r, 'peak_rss_mb', 1, '{:.0f}'):>7}")
    print("prompt/decode in tok/s (medians of %d); decode: batch 1, %d tokens, greedy; "
          "ready = process spawn until answerable; load = load + warm-up in-process"
          % (spec["repeats"], spec["gen_tokens"]))


def print_ratios(results: dict[str, dict]) -> None:
    ours, serve = results.get("freetoken", {}), results.get("ft_serve", {})
    for peer in ("llama_cpp", "transformers"):
        other = results.get(peer)
        if not other or "unavailable" in other or not ours or "unavailable" in ours:
            continue
        parts = [f"decode x{ours['decode_tok_s'] / other['decode_tok_s']:.2f}"]
        for n in ("42", "520"):
            parts.append(f"prompt{n} x{ours['prompt_tok_s'][n] / other['prompt_tok_s'][n]:.2f}")
        parts.append(f"TTFT x{other['ttft_s'] / ours['ttft_s']:.2f}")
        start = serve.get("start_to_ready_s", ours["start_to_ready_s"])
        parts.append(f"start->ready x{other['start_to_ready_s'] / start:.2f}")
        rss = serve.get("peak_rss_mb", ours["peak_rss_mb"])
        parts.append(f"RSS x{rss / other['peak_rss_mb']:.2f}")
        print(f"FreeToken vs {LABELS[peer]} (>1 = FreeToken better, RSS: ours/theirs): "
              + ", ".join(parts))


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
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    from freetoken.models.default import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    lengths = tuple(int(n) for n in args.prompt_lens.split(","))
    spec = {"model": str(model), "model_arg": args.model is not None, "threads": args.threads,
            "repeats": args.repeats, "gen_tokens": args.gen_tokens,
            "prompts": prompts_for(model, lengths)}
    os.environ.setdefault("FREETOKEN_NUM_THREADS", str(args.threads))
    skip = set(filter(None, args.skip.split(",")))
    print(machine_line(), flush=True)
    results: dict[str, dict] = {}
    if "freetoken" not in skip or "ft_serve" not in skip:
        spawn_worker("freetoken", spec, start_only=True)   # builds kernels on a first run
    for peer in PEERS:
        if peer in skip:
            continue
        print(f"measuring {LABELS[peer]} ...", file=sys.stderr, flush=True)
        if peer == "ft_serve":
            results[peer] = run_ft_serve(spec, args.start_repeats)
        else:
            repeats = 1 if peer == "transformers" else args.start_repeats
            results[peer] = run_peer(peer, spec, repeats)
    floor = import_torch_seconds(max(1, args.start_repeats))
    print(f"load average after: {os.getloadavg()[0]:.1f}; spawning Python + `import torch` alone "
          f"takes {floor:.2f} s (median), the floor of FreeToken's start->ready")
    print_table(results, spec)
    print_ratios(results)
    print(REFERENCE)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"machine": machine_line(), "spec": {
            k: v for k, v in spec.items() if k != "prompts"}, "import_torch_s": floor,
            "results": results}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:])
