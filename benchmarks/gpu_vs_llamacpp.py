"""FreeToken beside llama.cpp's CUDA build on one GPU, same shapes, same random bf16 weights,
with the batch-1 bandwidth ceiling measured in the same run.

    python benchmarks/gpu_vs_llamacpp.py [--shapes smollm2,qwen3-8b,qwen3-30b-a3b,...]
        [--peer DIR] [--work DIR] [--engines freetoken,llama.cpp] [--results FILE] [--gen 128]

Per shape (SmolLM2-135M; Qwen3-8B at 8 layers; Qwen3-30B-A3B at 12 layers in bf16 and Q4_K_M;
Qwen3.6-35B-A3B at 8 layers, 6 Gated DeltaNet + 2 full attention): the random-weight
HF folder is written once; FreeToken loads it through the engine (CUDA graphs) and gives decode
tok/s at batch 1, 8 and 32, prefill tok/s at 512 and 2048 tokens, and the GPU time of one decode
step (graph replay between CUDA events) beside the wall time per step. llama.cpp: the folder is
converted by its own converter (`DIR/to_gguf.py`) and measured by `DIR/bench.py` (llama-bench and
llama-batched-bench), the scripts of ../shared/peers/llama-cpp-cuda staged by its prepare.sh. The
peer needs a finished llama.cpp build in $LCPP_HOME (default /root/llama.cpp-peer, made by
DIR/build.sh, ~7 min): without one, its columns say so and FreeToken's still run. The Q4_K_M
row needs that build for FreeToken too: both engines load the file `llama-quantize` wrote, and its
ceiling is llama.cpp's own (bandwidth / bytes of that file one step reads). With --work and
--results the engines can run in separate calls of one GPU session (FreeToken while llama.cpp
builds, then llama.cpp): folders are reused and the report pairs the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_decode, gpu_hybrid, gpu_moe  # noqa: E402

SHAPES = ("smollm2", "qwen3-8b", "qwen3-30b-a3b", "qwen3-30b-a3b-q4km", "qwen3.6-35b-a3b")
QUANTIZED = {"qwen3-30b-a3b-q4km": "Q4_K_M"}   # shape -> llama-quantize type of the bf16 folder
HYBRID_LAYERS = 8
MOE_LAYERS = 12
BATCHES = (1, 8, 32)
PREFILLS = (512, 2048)
PREFILL_REPS = 3   # timed prompts per length, after one warm-up (llama-bench: -r 3 after its own)


def build_shape(name: str, directory: Path, context: int) -> int:
    """Save the random-weight HF folder; the bytes one batch-1 step at `context` reads. The
    model is freed before returning: both engines need the GPU memory."""
    if name.startswith("qwen3-30b-a3b"):
        model = gpu_moe.build(directory, MOE_LAYERS)
        step = gpu_moe.bytes_per_token(model.config, context)
    elif name == "qwen3.6-35b-a3b":
        model = gpu_hybrid.build(directory, HYBRID_LAYERS)
        step = gpu_hybrid.bytes_per_token(model.config, context)
    else:
        model = gpu_decode.build(name, directory)
        step = gpu_decode.bytes_per_step(model, context)
    del model
    torch.cuda.empty_cache()
    return step


def graph_step_ms(engine, size: int, reps: int = 50) -> float | None:
    """GPU time of one captured decode step of `size` rows (median replay between events)."""
    graphs = getattr(engine, "graphs", None)
    if graphs is None or size not in graphs.graphs:
        return None
    graph, times = graphs.graphs[size], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def freetoken(folder: str, gen: int) -> dict:
    """Decode at each batch, prefill at each length, graph replay time; through the engine."""
    from freetoken.cli.bench import _batch
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model

    loaded = load_model(folder, device="cuda")
    need = max(max(BATCHES) * (128 + gen), max(PREFILLS) + 16)
    config = EngineConfig(num_tokens=need + 256, max_num_seqs=max(BATCHES),
                          max_prefill_tokens=max(PREFILLS), device="cuda", prefix_cache=False)
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    # whether the load-time rule put the fused decode layers in (FREETOKEN_FUSED_DECODE)
    vocab, out = loaded.config.vocab_size, {
        "fused_decode": getattr(loaded.model, "_fused", None) is not None}
    try:
        asyncio.run(_batch(engine, 1, 16, 4, vocab))  # settle allocations and graphs
        for n in PREFILLS:  # a warm-up at each length (first-use allocations), then a median
            ttfts = [asyncio.run(_batch(engine, 1, n, 1, vocab))["ttft_s"]
                     for _ in range(1 + PREFILL_REPS)]
            out[f"prefill{n}"] = n / statistics.median(ttfts[1:])
        for b in BATCHES:
            row = asyncio.run(_batch(engine, b, 128, gen, vocab))
            out[f"decode_bs{b}"] = row["decode_tok_s"]
            out[f"wall_ms_bs{b}"] = 1e3 * b / row["decode_tok_s"]
            out[f"gpu_ms_bs{b}"] = graph_step_ms(engine, b)
    finally:
        engine.shutdown()
    del engine, loaded
    torch.cuda.empty_cache()
    return out


def peer_gguf(folder: Path, work: Path, peer: Path | None, quant: str | None) -> Path | str:
    """The folder converted by llama.cpp's converter (and quantized when asked), or why not."""
    home = Path(os.environ.get("LCPP_HOME", "/root/llama.cpp-peer"))
    if peer is None or not (peer / "bench.py").is_file():
        return "no peer scripts (pass --peer, the folder prepare.sh staged)"
    if not (home / "build" / "bin" / "llama-bench").is_file():
        return f"no llama.cpp build in {home} (run {peer}/build.sh, or set LCPP_HOME)"
    gguf = work / f"{folder.name}.gguf"
    extra = ["--no-mtp"] if folder.name.startswith("qwen3.6") else []
    conv = subprocess.run([sys.executable, str(peer / "to_gguf.py"), str(folder), str(gguf),
                           "bf16", *extra], capture_output=True, text=True)
    if conv.returncode:
        return f"to_gguf.py failed: {conv.stderr[-500:]}"
    if quant is None:
        return gguf
    quantized = work / f"{folder.name}-{quant.lower()}.gguf"
    run = subprocess.run([str(home / "build" / "bin" / "llama-quantize"), str(gguf),
                          str(quantized), quant], capture_output=True, text=True)
    gguf.unlink(missing_ok=True)
    return quantized if run.returncode == 0 else f"llama-quantize failed: {run.stderr[-500:]}"


def llamacpp(gguf: Path, peer: Path) -> dict:
    """llama.cpp's figures for the GGUF file, or {"skipped": why}."""
    run = subprocess.run([sys.executable, str(peer / "bench.py"), str(gguf), "--batched"],
                         capture_output=True, text=True)
    if run.returncode:
        return {"skipped": f"bench.py failed: {run.stderr[-500:]}"}
    out = {}
    for line in run.stdout.splitlines():
        d = json.loads(line) if line.startswith("{") else {}
        if "ceiling_tok_s" in d:
            out["ceiling"] = d["ceiling_tok_s"]
        what = d.get("what", "")
        if what.startswith("prefill"):
            out[what.removesuffix("_tok_s")] = d["value"]
        elif what == "decode_bs1_tok_s":
            out["decode_bs1"] = d["value"]
        elif what.endswith("_aggregate_tok_s") and what != "decode_bs1_aggregate_tok_s":
            out[what.removesuffix("_aggregate_tok_s")] = d["value"]
    return out


def _cell(v, fmt="{:.1f}") -> str:
    return f"{'-' if v is None else fmt.format(v):>12}"


def report(name: str, ours: dict, peer: dict, ceiling: float) -> None:
    print(f"\n== {name} ==  batch-1 ceiling {ceiling:.0f} tok/s (D2D bandwidth / step bytes)"
          + (f"; llama.cpp's own ceiling of its GGUF: {peer['ceiling']:.0f}" if "ceiling" in peer
             else ""))
    print(f"FreeToken decode steps of up to 4 tokens: "
          f"{'fused kernels' if ours.get('fused_decode') else 'unfused chain'}")
    if "skipped" in peer:
        print(f"llama.cpp: skipped: {peer['skipped']}")
    print(f"{'':26}{'FreeToken':>12}{'llama.cpp':>12}{'ratio':>8}{'% ceiling':>11}")
    for key in [f"decode_bs{b}" for b in BATCHES] + [f"prefill{n}" for n in PREFILLS]:
        a, b = ours.get(key), peer.get(key)
        ratio = f"{a / b:8.2f}" if a and b else f"{'-':>8}"
        pct = f"{100 * a / ceiling:10.0f}%" if key == "decode_bs1" else ""
        print(f"{key + ' (tok/s)':26}{_cell(a)}{_cell(b)}{ratio}{pct}")
    for b in BATCHES:
        print(f"  one decode step, batch {b:>2}: GPU (graph replay) "
              f"{_cell(ours.get(f'gpu_ms_bs{b}'), '{:.3f}')} ms, wall "
              f"{_cell(ours.get(f'wall_ms_bs{b}'), '{:.3f}')} ms")


def measure(name: str, folder: Path, work: Path, args, bandwidth: float, entry: dict) -> None:
    """Fill `entry` with this shape's ceiling and each asked engine's figures. A folder (and a
    quantized file) already in `work` is reused, so the engines may run in separate calls."""
    if not (folder / "config.json").is_file() or "ceiling_tok_s" not in entry:
        folder.mkdir(parents=True, exist_ok=True)
        entry["ceiling_tok_s"] = bandwidth / build_shape(name, folder, 128 + args.gen // 2)
    quant = QUANTIZED.get(name)
    gguf: Path | str = work / f"{folder.name}-{quant.lower()}.gguf" if quant else ""
    if "llama.cpp" in args.engines or (quant and not Path(gguf).is_file()):
        gguf = peer_gguf(folder, work, args.peer, quant)
        if "llama.cpp" in args.engines:
            entry["llama.cpp"] = (llamacpp(gguf, args.peer) if isinstance(gguf, Path)
                                  else {"skipped": gguf})
            if isinstance(gguf, Path) and not quant:
                gguf.unlink(missing_ok=True)
    if quant and "ceiling" in entry.get("llama.cpp", {}):
        entry["ceiling_tok_s"] = entry["llama.cpp"]["ceiling"]   # the file's own step bytes
    if "freetoken" in args.engines:
        if quant and not Path(gguf).is_file():
            entry["freetoken"] = {"skipped": f"FreeToken loads llama-quantize's file: {gguf}"}
        else:
            entry["freetoken"] = freetoken(str(gguf if quant else folder), args.gen)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--peer", type=Path, default=None,
                   help="folder with llama.cpp-cuda's to_gguf.py and bench.py (prepare.sh DEST)")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the models, kept and reused (default: a temp dir)")
    p.add_argument("--engines", default="freetoken,llama.cpp",
                   help="which engines to measure this call (freetoken, llama.cpp or both)")
    p.add_argument("--results", type=Path, default=None,
                   help="JSON file of figures, read first and updated: run the engines in two "
                        "calls of one session and the report puts them side by side")
    p.add_argument("--gen", type=int, default=128)
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"--shapes: unknown {', '.join(bad)}; known: {', '.join(SHAPES)}")
    args.engines = {e for e in args.engines.split(",") if e}
    if not args.engines or args.engines - {"freetoken", "llama.cpp"}:
        raise SystemExit("--engines: freetoken, llama.cpp or both, comma-separated")
    results = {}
    if args.results is not None and args.results.is_file():
        try:
            results = json.loads(args.results.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--results {args.results}: not this script's JSON ({exc}); "
                             f"pass a new file") from None
    bandwidth, start = gpu_decode.d2d_bandwidth(), time.perf_counter()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = args.work or Path(tmp)
        for name in shapes:
            entry = results.setdefault(name, {})
            measure(name, work / name, work, args, bandwidth, entry)
            ours = entry.get("freetoken", {"skipped": "not measured"})
            if "skipped" in ours:
                print(f"\n== {name} == FreeToken skipped: {ours['skipped']}")
            else:
                report(name, ours, entry.get("llama.cpp", {"skipped": "not measured"}),
                       entry["ceiling_tok_s"])
            if args.results is not None:
                args.results.write_text(json.dumps(results, default=str))
            if args.work is None:
                subprocess.run(["rm", "-rf", str(work / name)], check=False)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
