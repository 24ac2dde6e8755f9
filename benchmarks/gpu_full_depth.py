"""A full-depth MoE in Q4_K_M or FP8 on one GPU (the 48-layer Qwen3-30B-A3B, or with --model
qwen3.6-35b-a3b the 40-layer hybrid Qwen3.6-35B-A3B): FreeToken under GPU memory budgets beside
llama.cpp (every layer on the GPU, or -ncmoe N experts on the CPU) on the same file.

    python benchmarks/gpu_full_depth.py [--work DIR] [--engines freetoken,llama.cpp]
        [--format q4_k_m|fp8] [--gpu-memory-limit 24GiB[,16GiB,...]] [--context 32768]
        [--moe-cache-rate auto] [--n-cpu-moe 0[,N,...]] [--batches 1[,4]] [--gen 128]
        [--results FILE] [--drop-file]

The Q4_K_M file (~17 GiB; 19.7 GiB for Qwen3.6) is written directly by
benchmarks/write_gguf_moe.py (write_gguf_hybrid.py), the FP8 folder (~31 GB; ~37 GB for
Qwen3.6; 128x128 blocks) by benchmarks/write_fp8_folder.py, into --work (default
~/ft-full-depth) and reused by later calls (--drop-file deletes it at the end): its bf16 source
would not fit the disk. llama.cpp reads no FP8 checkpoint: FP8 rows are FreeToken's alone.

FreeToken: load_model + the engine with the engine config's gpu_memory_limit (`ft serve
--gpu-memory-limit`) and a KV pool of --context tokens for one sequence; the start-up memory
plan decides whether the experts stay resident or go to pinned host memory behind a GPU cache.
Where this runtime has no gpu_memory_limit yet, the budget is imposed from outside instead: a
ballast allocation leaves only the limit free before the model loads (the report says which).
Reported per budget (several run one after the other, e.g. 24GiB resident and 16GiB with the
experts offloaded in their blocks): resident or offloaded (cache rate), the plan's pools, load
time, decode tok/s at each of --batches (and the engine's stats), peak GPU memory. An
offloaded row adds its expert hit rate and miss bytes per token and its ceiling: 1 / max(the
resident step time of this run's resident row, miss bytes per token / the pinned H2D bandwidth
measured in the run), copies perfectly hidden.

llama.cpp: llama-bench -ngl 99 -fa 1 -r 3 (decode tg128, prefill pp512/pp2048) for each
--n-cpu-moe value (0: everything on the GPU), with the peak GPU memory it used (nvidia-smi).

Both beside the batch-1 ceiling of the file measured in the same run: D2D bandwidth / (the
file's step bytes, benchmarks/step_bytes.py, + the KV of the measured context).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks import write_gguf_moe  # noqa: E402

GIB = 1 << 30


def models() -> dict:
    """--model name -> (its writer module, its full shape, its display name)."""
    from benchmarks import write_gguf_hybrid

    return {"qwen3-30b-a3b": (write_gguf_moe, write_gguf_moe.QWEN3_30B_A3B, "Qwen3-30B-A3B"),
            "qwen3.6-35b-a3b": (write_gguf_hybrid, write_gguf_hybrid.QWEN36_35B_A3B,
                                "Qwen3.6-35B-A3B")}


def kv_layers(shape) -> int:
    """The layers that keep K and V (a hybrid's full-attention layers only)."""
    full = getattr(shape, "is_full_attention", None)
    return shape.layers if full is None else sum(full(i) for i in range(shape.layers))


def ensure_file(work: Path, layers: int, model: str = "qwen3-30b-a3b",
                fmt: str = "q4_k_m") -> Path:
    """The model's Q4_K_M file (or FP8 folder) of `layers` layers in `work`, written unless a
    finished one is there (each is renamed into place only once complete)."""
    writer, full, _ = models()[model]
    shape = dataclasses.replace(full, layers=layers)
    if fmt == "fp8":
        from benchmarks import write_fp8_folder

        path = work / f"{model}-{layers}L-fp8"
        if (path / "config.json").is_file():
            return path
        work.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        counts = write_fp8_folder.write_folder(path, model, layers, progress=_every_8th_shard)
        print(f"wrote {path} ({counts['bytes'] / GIB:.2f} GiB) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        return path
    path = work / f"{model}-{layers}L-q4km.gguf"
    if path.is_file():
        return path
    work.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    start = time.perf_counter()
    counts = writer.write_q4_k_m(part, shape, progress=_every_8th_layer())
    part.rename(path)
    print(f"wrote {path} ({counts['bytes'] / GIB:.2f} GiB) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return path


def _every_8th_shard(line: str) -> None:
    shard = int(line.split()[1].split("/")[0])
    if shard % 8 == 0:
        print(line, flush=True)


def checkpoint_bytes(path: Path) -> int:
    """A GGUF file's size, or an HF folder's."""
    return path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.iterdir() if f.is_file())


def _every_8th_layer():
    def show(line: str) -> None:
        layer = int(line.split("/")[0].split()[-1])
        if layer % 8 == 0:
            print(line, flush=True)
    return show


def budget(limit_text: str):
    """(EngineConfig field value or None, ballast bytes or 0, how the limit is imposed)."""
    import torch

    from freetoken.engine import config as engine_config

    parse = getattr(engine_config, "parse_gpu_memory_limit", None)
    fields = {f.name for f in dataclasses.fields(engine_config.EngineConfig)}
    if parse is not None and "gpu_memory_limit" in fields:
        return parse(limit_text), 0, f"EngineConfig.gpu_memory_limit = {limit_text}"
    size = _size(limit_text)
    free, _ = torch.cuda.mem_get_info()
    ballast = max(0, free - size)
    return None, ballast, (f"no gpu_memory_limit in this runtime: a {ballast / GIB:.1f} GiB "
                           f"ballast leaves {limit_text} free")


def _size(text: str) -> int:
    units = {"gib": GIB, "g": GIB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6}
    lowered = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda u: -len(u[0])):
        if lowered.endswith(unit):
            return int(float(lowered[:-len(unit)]) * scale)
    return int(lowered)


def freetoken(path: Path, args) -> dict:
    """Load under the budget, decode at batch 1; the plan and the figures. The GPU is left
    empty afterwards (llama.cpp runs next in the same process's view of memory)."""
    import gc
    import traceback

    import torch

    from freetoken.engine.config import EngineConfigError
    from freetoken.models.errors import ModelError

    limit, ballast_bytes, how = budget(args.gpu_memory_limit)
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda") \
        if ballast_bytes else None
    out: dict = {"budget": how}
    torch.cuda.reset_peak_memory_stats()
    try:
        out.update(_load_and_decode(path, args, limit))
    except (ModelError, EngineConfigError) as exc:
        out["refused"] = str(exc)
    except Exception as exc:  # noqa: BLE001 (reported; llama.cpp's part still runs)
        traceback.print_exc()
        out["refused"] = f"failed: {type(exc).__name__}: {exc}"
    out["torch_peak_reserved_gib"] = (torch.cuda.max_memory_reserved() - ballast_bytes) / GIB
    del ballast
    gc.collect()
    torch.cuda.empty_cache()
    if out.get("resident") is False:
        from freetoken.engine.offload_policy import measure_h2d

        out["h2d_GBps"] = measure_h2d(torch, torch.device("cuda"), GIB, 3) / 1e9
        # its 1 GiB device buffer stays in torch's cache: held by this process, it would count
        # against the next configuration's --gpu-memory-limit (a lower cache rate there)
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _load_and_decode(path: Path, args, limit) -> dict:
    from freetoken.cli.bench import _batch
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_setup import OffloadConfig, OffloadPlanner, parse_cache_rate
    from freetoken.models.loader import load_model, resolve_device

    batches = [int(b) for b in args.batches.split(",")]
    settings = dict(num_tokens=args.context, max_num_seqs=max(batches),
                    max_prefill_tokens=2048, device="cuda", prefix_cache=False)
    if limit is not None:
        settings["gpu_memory_limit"] = limit
    config = EngineConfig(**settings)
    planner = OffloadPlanner(config, OffloadConfig(cache_rate=parse_cache_rate(
        args.moe_cache_rate), cpu=args.moe_cpu, prefetch=args.moe_prefetch),
        resolve_device("cuda"))
    start = time.perf_counter()
    loaded = load_model(str(path), device="cuda", plan=planner)
    decision = planner.decision
    out = dict(load_s=time.perf_counter() - start, resident=not decision.offloaded,
               moe_cache_rate=decision.rate, kv_tokens=decision.num_tokens,
               plan=decision.plan.describe())
    print(f"FreeToken: loaded in {out['load_s']:.0f} s, "
          f"{'resident' if out['resident'] else f'experts offloaded, rate {decision.rate:.3f}'}"
          f"; memory plan: {out['plan']}", flush=True)
    engine = Engine.from_loaded(loaded, config, decision).start()
    try:
        engine.warm_up()
        vocab = loaded.config.vocab_size
        asyncio.run(_batch(engine, 1, 16, 4, vocab))
        for trace in args.traces.split(","):
            if trace != "model" or len(args.traces.split(",")) > 1:
                from benchmarks.gpu_offload import set_trace

                set_trace(engine, trace)
            tag = "" if trace == "model" else f"_{trace}"
            for batch in batches:
                before = engine.stats()
                row = asyncio.run(_batch(engine, batch, 128, args.gen, vocab))
                out[f"decode{tag}_bs{batch}"] = row["decode_tok_s"]
                out[f"ttft_128{tag}_bs{batch}_s"] = row["ttft_s"]
                if not out["resident"]:
                    out[f"offload{tag}_bs{batch}"] = _offload_delta(before, engine.stats())
                print(f"  {trace} routing, batch {batch}: {row['decode_tok_s']:.1f} tok/s"
                      + (f", {out[f'offload{tag}_bs{batch}']}" if not out["resident"] else ""),
                      flush=True)
        if args.profile and not out["resident"]:
            from benchmarks.offload_timeline import profile_decode

            for batch in batches:
                timeline = profile_decode(engine, batch, vocab)
                out[f"timeline_bs{batch}"] = dataclasses.asdict(timeline)
                print(f"  timeline, batch {batch}, {timeline.steps} steps: "
                      f"{timeline.describe()}", flush=True)
        out.update(engine_stats=engine.stats())
    finally:
        engine.shutdown()
        if hasattr(loaded.model, "close"):
            loaded.model.close()
    return out


def _offload_delta(before: dict, after: dict) -> dict:
    """The expert cache's decode hit rate and decode miss bytes per generated token between two
    stats snapshots (misses x the mean expert's bytes in its format: the prompt's streamed
    layers are not decode traffic)."""
    d = {k: after[k] - before[k] for k in ("expert_hits", "expert_misses", "tokens_generated",
                                           "expert_prefetched", "expert_prefetch_hits")}
    looked = d["expert_hits"] + d["expert_misses"]
    expert = after["pinned_bytes"] / (after["moe_layers"] * after["num_experts"])
    tokens = max(d["tokens_generated"], 1)
    # prefetched experts are copied too: a right guess turns a miss into a hit, a wrong one
    # is traffic that no miss counts
    return {"hit_rate": d["expert_hits"] / looked if looked else 0.0,
            "miss_bytes_per_token": d["expert_misses"] * expert / tokens,
            "prefetch_bytes_per_token": d["expert_prefetched"] * expert / tokens,
            "prefetch_accuracy": (d["expert_prefetch_hits"] / d["expert_prefetched"]
                                  if d["expert_prefetched"] else 0.0)}


def llamacpp(path: Path, n_cpu_moe: list[int]) -> dict:
    """llama-bench's figures and VRAM per --n-cpu-moe value, or {"skipped": why}."""
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.bench import bench

    if path.is_dir():
        return {"skipped": "llama.cpp reads no FP8 checkpoint: this row is FreeToken's alone"}
    out = {}
    for n in n_cpu_moe:
        try:
            figures = bench(path, batched=False, n_cpu_moe=n, vram=True)
        except paths.PeerUnavailable as exc:
            return {"skipped": str(exc)}
        out[f"ncmoe{n}"] = figures
        print(f"llama.cpp -ncmoe {n}: {json.dumps(figures)}", flush=True)
    return out


def touched_ceiling(entry: dict, batch: int) -> float:
    """Decode tok/s at `batch` if a step read only what it touches, once, at the measured D2D
    bandwidth: the dense weights, every expert any of the `batch` tokens routes to, and each
    sequence's KV. Under uniform routing each token picks top_k of E experts independently
    (TraceRouter's noise is fresh per token), so a layer touches E (1 - (1 - k/E)^batch)
    experts in expectation."""
    experts, k = entry["experts"], entry["top_k"]
    routed_all = entry["routed_bytes"] * experts / k
    kv = entry["kv_bytes"]    # one sequence's KV at the run's mean context
    dense = entry["step_bytes"] - entry["routed_bytes"] - kv
    touched = routed_all * (1.0 - (1.0 - k / experts) ** batch)
    return batch * entry["bandwidth_Bps"] / (dense + touched + batch * kv)


def report(entry: dict) -> None:
    ceiling = entry["ceiling_tok_s"]
    print(f"\n== {entry.get('model', 'Qwen3-30B-A3B')}, {entry['layers']} layers, "
          f"{entry.get('format', 'Q4_K_M')} ({entry['file_gib']:.2f} GiB) ==")
    print(f"batch-1 ceiling {ceiling:.0f} tok/s (D2D {entry['bandwidth_Bps'] / 1e12:.2f} TB/s / "
          f"{entry['step_bytes'] / 1e9:.3f} GB: the file's step bytes + KV of the context)")
    rows = {k: v for k, v in entry.items() if k.startswith("freetoken")}
    resident = next((r for r in rows.values() if r.get("resident") and "decode_bs1" in r), None)
    for ours in rows.values():
        print(f"FreeToken ({ours['budget']}):")
        if "refused" in ours:
            print(f"  refused: {ours['refused']}")
            continue
        where = "resident" if ours["resident"] else \
            f"experts offloaded in their format, cache rate {ours['moe_cache_rate']:.3f}"
        print(f"  {where}; KV pool {ours['kv_tokens']} tokens; load {ours['load_s']:.0f} s")
        print(f"  plan: {ours['plan']}")
        for key in sorted(k for k in ours if k.startswith("decode") and "_bs" in k):
            tag, batch = key[len("decode"):].rsplit("_bs", 1)
            batch = int(batch)
            trace = tag.lstrip("_") or "model"
            line = f"  {trace} routing, decode batch {batch}: {ours[key]:.1f} tok/s"
            if batch == 1 and trace == "model":
                line += f" ({100 * ours[key] / ceiling:.0f}% of the resident ceiling)"
            elif ours["resident"] and trace == "uniform" and "routed_bytes" in entry:
                touched = touched_ceiling(entry, batch)
                line += (f" ({100 * ours[key] / touched:.0f}% of {touched:.0f} tok/s, the "
                         f"ceiling over the experts {batch} tokens touch)")
            off = ours.get(f"offload{tag}_bs{batch}")
            if off and "h2d_GBps" in ours:
                moved = off["miss_bytes_per_token"] + off.get("prefetch_bytes_per_token", 0.0)
                copy = ours["h2d_GBps"] * 1e9 / max(moved, 1)
                step = resident.get(key) if resident else None
                bound = min(copy, step) if step else copy
                if off.get("prefetch_bytes_per_token"):
                    line += (f"; prefetched {off['prefetch_bytes_per_token'] / 1e6:.1f} MB/token"
                             f", {100 * off['prefetch_accuracy']:.0f}% of it routed")
                line += (f"; hit rate {off['hit_rate']:.3f}, miss "
                         f"{off['miss_bytes_per_token'] / 1e6:.1f} MB/token; ceiling "
                         f"{bound:.1f} tok/s (copies at {ours['h2d_GBps']:.1f} GB/s"
                         + (f", resident step {step:.1f} tok/s" if step else "")
                         + f"): {100 * ours[key] / bound:.0f}%")
            print(line)
        for key in sorted(k for k in ours if k.startswith("timeline_bs")):
            from benchmarks.offload_timeline import Timeline

            print(f"  timeline, batch {key[len('timeline_bs'):]}: "
                  f"{Timeline(**ours[key]).describe()}")
    peer = entry.get("llama.cpp")
    if peer:
        if "skipped" in peer:
            print(f"llama.cpp: skipped: {peer['skipped']}")
        for key, fig in (peer if "skipped" not in peer else {}).items():
            vram = fig.get("vram_mib", {}).get("llama-bench")
            print(f"llama.cpp -ngl 99 -ncmoe {key[len('ncmoe'):]}: decode bs1 "
                  f"{fig.get('decode_bs1', '-')} tok/s, pp512 {fig.get('prefill512', '-')}, "
                  f"pp2048 {fig.get('prefill2048', '-')}, "
                  f"VRAM {vram if vram is not None else '-'} MiB"
                  + (f"; errors {fig['errors']}" if "errors" in fig else ""))
    if resident and "decode_bs1" in resident and peer and \
            peer.get("ncmoe0", {}).get("decode_bs1"):
        print(f"FreeToken / llama.cpp (all on GPU), decode batch 1: "
              f"{resident['decode_bs1'] / peer['ncmoe0']['decode_bs1']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path.home() / "ft-full-depth")
    p.add_argument("--model", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b",
                                                                   "qwen3.6-35b-a3b"))
    p.add_argument("--layers", type=int, default=None,
                   help="cut the depth (default: the model's, 48 or 40)")
    p.add_argument("--engines", default="freetoken,llama.cpp")
    p.add_argument("--gpu-memory-limit", default="24GiB",
                   help="FreeToken's budget; several (comma-separated) run one after the other")
    p.add_argument("--batches", default="1", help="decode batch sizes, comma-separated")
    p.add_argument("--traces", default="model",
                   help="routing per run: model (its own router), uniform, skewed "
                        "(benchmarks/gpu_offload.TraceRouter), comma-separated")
    p.add_argument("--context", type=int, default=32768, help="FreeToken's KV pool (tokens)")
    p.add_argument("--moe-cache-rate", default="auto",
                   help="auto (from the budget) or a rate; pass one rate to compare options: "
                        "configurations after the first planned with about 0.25 GiB less "
                        "(held by this process after the first engine), hence a lower auto "
                        "rate (0.563, then 0.550 at 16 GiB on an H100)")
    p.add_argument("--moe-cpu", default="off", choices=("off", "auto"),
                   help="offloaded experts: auto computes misses on the CPU where it beats "
                        "copying them (ft serve --moe-cpu)")
    p.add_argument("--moe-prefetch", default="off",
                   help="offloaded experts: on copies the next layer's predicted misses while "
                        "a layer computes (ft serve --moe-prefetch); off,on runs both")
    p.add_argument("--profile", action="store_true",
                   help="offloaded: profile a window of decode steps per batch size (kernels, "
                        "copies, GPU idle, the cache's host calls; benchmarks/offload_timeline)")
    p.add_argument("--format", default="q4_k_m", choices=("q4_k_m", "fp8"),
                   help="the checkpoint: a Q4_K_M GGUF file, or an FP8 folder (FreeToken only)")
    p.add_argument("--n-cpu-moe", default="0", help="llama-bench -ncmoe values, comma-separated")
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--results", type=Path, default=None, help="JSON file, read and updated")
    p.add_argument("--driver-copies", default="",
                   help="offloaded experts: off (torch's copy_), on (FREETOKEN_DRIVER_COPIES=1: "
                        "the CUDA driver's cuMemcpyHtoDAsync) or off,on for both; default: "
                        "as the environment says")
    p.add_argument("--drop-file", action="store_true",
                   help="delete the checkpoint at the end (keep it for a later call otherwise)")
    args = p.parse_args()
    if args.layers is None:
        args.layers = models()[args.model][1].layers
    engines = {e for e in args.engines.split(",") if e}
    if not engines or engines - {"freetoken", "llama.cpp"}:
        raise SystemExit("--engines: freetoken, llama.cpp or both, comma-separated")
    prefetch_modes = args.moe_prefetch.split(",")
    if not prefetch_modes or set(prefetch_modes) - {"on", "off"}:
        raise SystemExit(f"--moe-prefetch: on, off or both, comma-separated; got "
                         f"{args.moe_prefetch!r}")
    driver_modes = [m for m in args.driver_copies.split(",") if m] or [None]
    if set(driver_modes) - {"on", "off", None}:
        raise SystemExit(f"--driver-copies: on, off or both, comma-separated; got "
                         f"{args.driver_copies!r}")
    from benchmarks.gpu_decode import d2d_bandwidth
    from benchmarks.step_bytes import KV_ITEM, gguf_weight_bytes, safetensors_weight_bytes

    results = json.loads(args.results.read_text()) if args.results and \
        args.results.is_file() else {}
    path = ensure_file(args.work, args.layers, args.model, args.format)
    _, full, label = models()[args.model]
    shape = dataclasses.replace(full, layers=args.layers)
    bandwidth = d2d_bandwidth()
    # the copy's buffers stay in torch's cache: held by this process, they would count against
    # --gpu-memory-limit (2 GiB on the H100, which pushed the experts out of VRAM)
    import torch

    torch.cuda.empty_cache()
    weights = safetensors_weight_bytes(path) if path.is_dir() else gguf_weight_bytes(path)
    kv = 2 * kv_layers(shape) * shape.kv_heads * shape.head_dim * KV_ITEM * (128 + args.gen // 2)
    tag = {"q4_k_m": "q4km", "fp8": "fp8"}[args.format]
    entry = results.setdefault(f"{args.model}-{args.layers}L-{tag}", {})
    entry.update(model=label, layers=args.layers, file=str(path),
                 format={"q4_k_m": "Q4_K_M", "fp8": "FP8"}[args.format],
                 file_gib=checkpoint_bytes(path) / GIB,
                 bandwidth_Bps=bandwidth, step_bytes=weights["weights"] + kv,
                 routed_bytes=weights["experts"], experts=shape.experts, top_k=shape.top_k,
                 kv_bytes=kv,
                 weight_bytes_by_type=weights["by_type"],
                 ceiling_tok_s=bandwidth / (weights["weights"] + kv))
    if "freetoken" in engines:
        environ_copies = os.environ.get("FREETOKEN_DRIVER_COPIES")
        for limit in args.gpu_memory_limit.split(","):
            for prefetch, driver in itertools.product(prefetch_modes, driver_modes):
                key = (f"freetoken@{limit}" + ("+prefetch" if prefetch == "on" else "")
                       + {"on": "+driver", "off": "+torch-copies", None: ""}[driver])
                if driver is not None:       # read when the engine's expert cache is made
                    os.environ["FREETOKEN_DRIVER_COPIES"] = "1" if driver == "on" else "0"
                entry[key] = freetoken(path, argparse.Namespace(
                    **{**vars(args), "gpu_memory_limit": limit, "moe_prefetch": prefetch}))
                entry[key]["budget"] += ", prefetch" if prefetch == "on" else ""
                entry[key]["budget"] += {"on": ", driver copies", "off": ", torch copies",
                                         None: ""}[driver]
        if environ_copies is None:
            os.environ.pop("FREETOKEN_DRIVER_COPIES", None)
        else:
            os.environ["FREETOKEN_DRIVER_COPIES"] = environ_copies
    if "llama.cpp" in engines:
        entry["llama.cpp"] = llamacpp(path, [int(n) for n in args.n_cpu_moe.split(",")])
    report(entry)
    if args.results is not None:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(entry, default=str))
    if args.drop_file:
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
