"""FreeToken beside llama.cpp's CUDA build on one GPU: same shapes, same weights, one run.

Each row is set against the batch-1 bandwidth ceiling measured in the same run.

    python benchmarks/gpu_vs_llamacpp.py [--shapes smollm2,qwen3-8b,qwen3-8b-q4km,...]
        [--peer DIR] [--work DIR] [--engines freetoken,llama.cpp] [--results FILE]
        [--gen 128] [--wait-peer SECONDS]

bf16 rows (SmolLM2-135M; Qwen3-8B at 8 layers; Qwen3-30B-A3B at 12 layers; Qwen3.6-35B-A3B at
8 layers, 6 Gated DeltaNet + 2 full attention): the random-weight HF folder is written once;
FreeToken loads it through the engine (CUDA graphs), llama.cpp the same folder converted by its
own converter to bf16 GGUF. Ceiling = D2D bandwidth / the bytes one batch-1 step reads (the
shape's formula, gpu_decode / gpu_moe / gpu_hybrid).

Quantized rows (benchmarks/gpu_quant_rows.py): `<shape>-q4km` and `<shape>-q8_0` for the three
Qwen shapes, both engines on the one GGUF llama-quantize made from the bf16 conversion;
`<shape>-fp8` and `<shape>-nvfp4`, FreeToken only. Their ceiling comes from the file's own
tensor table (benchmarks/step_bytes.py) plus the KV of the context.

Measured per row: decode tok/s at batch 1, 8 and 32, prefill tok/s at 512 and 2048 tokens,
FreeToken's GPU time of one decode step (graph replay between CUDA events) beside its wall time
per step. A table of ratios (FreeToken / llama.cpp) and % of ceiling closes the run.

llama.cpp comes from this repository's benchmarks/llama_cpp_cuda: the sources staged by
`python -m benchmarks.llama_cpp_cuda stage` (--peer DIR, default .carry/llama-cpp) and a build
in $LCPP_HOME (default ~/llama.cpp-peer) made by `... build` (~7-8 min; `--wait-peer S` waits
for one started in the background). Without them llama.cpp's columns say why and FreeToken's
still run (GGUF rows need llama-quantize for both). With --work and --results the engines can
run in separate calls of one GPU session: files are reused and the report pairs the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_decode, gpu_hybrid, gpu_moe, gpu_quant_rows  # noqa: E402

BF16_SHAPES = ("smollm2", "qwen3-8b", "qwen3-30b-a3b", "qwen3.6-35b-a3b")
SHAPES = BF16_SHAPES + tuple(gpu_quant_rows.ROWS)
HYBRID_LAYERS = 8
MOE_LAYERS = 12
BATCHES = (1, 8, 32)
PREFILLS = (512, 2048)
PREFILL_REPS = 3   # timed prompts per length, after one warm-up (llama-bench: -r 3 after its own)
_STEP_BYTES: dict[str, int] = {}   # bf16 shape -> step bytes of the folder built in this process


def build_shape(name: str, directory: Path, context: int) -> int:
    """Save the random-weight HF folder; the bytes one batch-1 step at `context` reads. The
    model is freed before returning: both engines need the GPU memory."""
    if name.startswith("qwen3-30b-a3b"):
        model = gpu_moe.build(directory, MOE_LAYERS)
        step = gpu_moe.bytes_per_token(model.config, context)
    elif name.startswith("qwen3.6-35b-a3b"):
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
    return gpu_decode.replay_ms(graphs.graphs[size], reps)


def freetoken(source: str, gen: int) -> dict:
    """Decode at each batch, prefill at each length, graph replay time; through the engine."""
    from freetoken.cli.bench import _batch
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model

    loaded = load_model(source, device="cuda")
    need = max(max(BATCHES) * (128 + gen), max(PREFILLS) + 16)
    config = EngineConfig(num_tokens=need + 256, max_num_seqs=max(BATCHES),
                          max_prefill_tokens=max(PREFILLS), device="cuda", prefix_cache=False)
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    # whether the load-time rule put the fused decode layers in (FREETOKEN_FUSED_DECODE)
    vocab, out = loaded.config.vocab_size, {
        "fused_decode": getattr(loaded.model, "_fused", None) is not None,
        "fused_tokens": getattr(loaded.model, "_fused_tokens", 0)}
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


class Peer:
    """llama.cpp's availability for this run: the staged sources (--peer) and the build,
    waited for once (--wait-peer) when one is running."""

    def __init__(self, staged: Path | None, wait_s: float):
        from benchmarks.llama_cpp_cuda import paths

        self.staged, self.wait_s, self._checked = paths.staged_dir(staged), wait_s, False

    def reason(self) -> str | None:
        """None when llama-bench is built, else why llama.cpp cannot run."""
        from benchmarks.llama_cpp_cuda import build, paths

        if not self._checked and self.wait_s > 0 and \
                paths.read_state().get("status") == "building":
            print(f"waiting up to {self.wait_s:.0f} s for the llama.cpp build ...", flush=True)
            build.wait(self.wait_s)
        self._checked = True
        try:
            paths.tool("llama-bench")
        except paths.PeerUnavailable as exc:
            return str(exc)
        return None


def llamacpp_bf16(folder: Path, work: Path, peer: Peer, keep: bool = False) -> dict:
    """llama.cpp's figures on the folder converted to bf16 GGUF, or {"skipped": why}. `keep`:
    leave the GGUF for a quantized row of the same shape later in the run."""
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.convert import convert

    if why := peer.reason():
        return {"skipped": why}
    gguf = work / f"{folder.name}.bf16.gguf"
    try:
        if not gguf.is_file():
            convert(folder, gguf, "bf16", peer.staged)
        figures = gpu_quant_rows.llamacpp_row(gguf)
    except (paths.PeerUnavailable, RuntimeError) as exc:
        return {"skipped": str(exc)}
    finally:
        if not keep:
            gguf.unlink(missing_ok=True)
    return figures


def _cell(v, fmt="{:.1f}") -> str:
    return f"{'-' if v is None else fmt.format(v):>12}"


def report(name: str, entry: dict) -> None:
    ours = entry.get("freetoken", {"skipped": "not measured"})
    peer = entry.get("llama.cpp", {"skipped": "not measured"})
    ceiling = entry["ceiling_tok_s"]
    how = (f"D2D bandwidth / {entry['step_bytes'] / 1e9:.3f} GB, the file's step bytes + KV"
           if "step_bytes" in entry else "D2D bandwidth / step bytes")
    print(f"\n== {name} ==  batch-1 ceiling {ceiling:.0f} tok/s ({how})")
    if "skipped" in ours:
        print(f"FreeToken: skipped: {ours['skipped']}")
    else:
        fused = ours.get("fused_tokens", 4) if ours.get("fused_decode") else 0
        print(f"FreeToken decode steps: fused kernels up to {fused} tokens" if fused
              else "FreeToken decode steps: the unfused chain")
    if "skipped" in peer:
        print(f"llama.cpp: skipped: {peer['skipped']}")
    print(f"{'':26}{'FreeToken':>12}{'llama.cpp':>12}{'ratio':>8}{'% ceiling':>11}")
    for key in [f"decode_bs{b}" for b in BATCHES] + [f"prefill{n}" for n in PREFILLS]:
        a, b = ours.get(key), peer.get(key)
        ratio = f"{a / b:8.2f}" if a and b else f"{'-':>8}"
        pct = f"{100 * a / ceiling:10.0f}%" if key == "decode_bs1" and a else ""
        print(f"{key + ' (tok/s)':26}{_cell(a)}{_cell(b)}{ratio}{pct}")
    for b in BATCHES:
        if ours.get(f"gpu_ms_bs{b}") is not None:
            print(f"  one decode step, batch {b:>2}: GPU (graph replay) "
                  f"{_cell(ours.get(f'gpu_ms_bs{b}'), '{:.3f}')} ms, wall "
                  f"{_cell(ours.get(f'wall_ms_bs{b}'), '{:.3f}')} ms")


def summary(results: dict, shapes: list[str]) -> None:
    """One line per row: FreeToken's figure, its ratio to llama.cpp, % of the ceiling."""
    keys = [f"decode_bs{b}" for b in BATCHES] + [f"prefill{n}" for n in PREFILLS]
    print(f"\n{'row':24}{'ceiling':>9}{'bs1 % ceil FT/lc':>18}" +
          "".join(f"{k.replace('decode_', ''):>17}" for k in keys))
    for name in shapes:
        entry = results.get(name, {})
        ours, peer = entry.get("freetoken", {}), entry.get("llama.cpp", {})
        ceiling = entry.get("ceiling_tok_s")
        pct = [f"{100 * e['decode_bs1'] / ceiling:.0f}%" if ceiling and e.get("decode_bs1")
               else "-" for e in (ours, peer)]
        cells = []
        for key in keys:
            a, b = ours.get(key), peer.get(key)
            cells.append(f"{a:.0f} ({a / b:.2f}x)" if a and b else f"{a:.0f}" if a else "-")
        print(f"{name:24}{ceiling or 0:9.0f}{' / '.join(pct):>18}" +
              "".join(f"{c:>17}" for c in cells))


def measure(name: str, work: Path, args, bandwidth: float, entry: dict, later: list[str],
            peer: Peer) -> None:
    """Fill `entry` with this row's ceiling and each asked engine's figures. Files already in
    `work` are reused, so the engines may run in separate calls."""
    context = 128 + args.gen // 2

    def build(base: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        _STEP_BYTES[base] = build_shape(base, folder, context)

    if name in gpu_quant_rows.ROWS:
        gpu_quant_rows.measure_row(name, work, args, bandwidth, entry, later, build, freetoken,
                                   peer.reason)
        return
    folder = work / name
    if not (folder / "config.json").is_file() or \
            ("ceiling_tok_s" not in entry and name not in _STEP_BYTES):
        build(name, folder)
    if "ceiling_tok_s" not in entry:
        entry.update(ceiling_tok_s=bandwidth / _STEP_BYTES[name], bandwidth_Bps=bandwidth)
    if "llama.cpp" in args.engines:
        _, keep = gpu_quant_rows.needed_later(gpu_quant_rows.QuantRow(name, name, "bf16"),
                                              later, work)
        entry["llama.cpp"] = llamacpp_bf16(folder, work, peer, keep)
    if "freetoken" in args.engines:
        entry["freetoken"] = gpu_quant_rows.freetoken_row(folder, args.gen, freetoken)


def _parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(BF16_SHAPES),
                   help=f"rows to run, comma-separated, of {','.join(SHAPES)}")
    p.add_argument("--peer", type=Path, default=None,
                   help="the staged llama.cpp folder (python -m benchmarks.llama_cpp_cuda stage; "
                        "default .carry/llama-cpp)")
    p.add_argument("--wait-peer", type=float, default=0.0,
                   help="seconds to wait for a llama.cpp build running in the background")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the models, kept and reused (default: a temp dir)")
    p.add_argument("--engines", default="freetoken,llama.cpp",
                   help="which engines to measure this call (freetoken, llama.cpp or both)")
    p.add_argument("--results", type=Path, default=None,
                   help="JSON file of figures, read first and updated: run the engines in two "
                        "calls of one session and the report puts them side by side")
    p.add_argument("--keep-files", action="store_true",
                   help="keep each quantized row's file in --work after both engines ran on it")
    p.add_argument("--gen", type=int, default=128)
    args = p.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in args.shapes if s not in SHAPES]:
        raise SystemExit(f"--shapes: unknown {', '.join(bad)}; known: {', '.join(SHAPES)}")
    args.engines = {e for e in args.engines.split(",") if e}
    if not args.engines or args.engines - {"freetoken", "llama.cpp"}:
        raise SystemExit("--engines: freetoken, llama.cpp or both, comma-separated")
    return args


def main() -> None:
    args = _parse_args()
    results = {}
    if args.results is not None and args.results.is_file():
        try:
            results = json.loads(args.results.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--results {args.results}: not this script's JSON ({exc}); "
                             f"pass a new file") from None
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    peer = Peer(args.peer, args.wait_peer)
    bandwidth, start = gpu_decode.d2d_bandwidth(), time.perf_counter()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = args.work or Path(tmp)
        for i, name in enumerate(args.shapes):
            entry = results.setdefault(name, {})
            measure(name, work, args, bandwidth, entry, args.shapes[i + 1:], peer)
            if "ceiling_tok_s" in entry:
                report(name, entry)
            else:
                why = {e: entry.get(e, {}).get("skipped") for e in sorted(args.engines)}
                print(f"\n== {name} == not measured: {why}")
            if args.results is not None:
                args.results.parent.mkdir(parents=True, exist_ok=True)
                args.results.write_text(json.dumps(results, default=str))
            if args.work is None and name in BF16_SHAPES and name not in args.shapes[i + 1:] \
                    and not any(gpu_quant_rows.ROWS[s].base == name for s in args.shapes[i + 1:]
                                if s in gpu_quant_rows.ROWS):
                subprocess.run(["rm", "-rf", str(work / name)], check=False)
        summary(results, args.shapes)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    print(json.dumps({k: results[k] for k in args.shapes if k in results}, default=str))


if __name__ == "__main__":
    main()
