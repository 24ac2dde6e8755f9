"""Decode and prefill at long context on one GPU: FreeToken beside llama.cpp's CUDA build in the
same run, every decode row against the bandwidth ceiling measured in that run.

    python benchmarks/gpu_long_context.py [--shapes qwen3-8b,qwen3.6-35b-a3b]
        [--depths 4096,16384,32768,65536,131072] [--batch-sizes 1,8]
        [--prefills 32768,131072] [--gen 64] [--engines freetoken,llama.cpp]
        [--kv-dtype auto|fp8] [--results FILE] [--work DIR] [--peer DIR] [--wait-peer SECONDS]

Shapes: `qwen3-8b` (Qwen3-8B at 8 of its layers, bf16), `qwen3.6-35b-a3b` (Qwen3.6-35B-A3B at
8 layers: 6 Gated DeltaNet + 2 full attention, bf16), and `<shape>-q4km` of either (llama-quantize's
Q4_K_M of the bf16 GGUF, both engines on that one file: benchmarks/gpu_quant_rows.py). The
random-weight HF folders are benchmarks/gpu_vs_llamacpp.py's, their max_position_embeddings raised
to the longest row (plain RoPE: the weights do not change); llama.cpp reads them through its own
converter. An empty --depths or --prefills leaves those rows out. `--kv-dtype fp8` measures
FreeToken's FP8 KV pool (rows keyed "... kv-fp8") beside llama.cpp's 8-bit cache
(`-ctk q8_0 -ctv q8_0`), the ceiling counting the pool's bytes (1 a element, plus a float32
scale per token and KV head).

Decode row (shape, batch B, depth D): B requests, each a distinct prompt of D tokens, decode
--gen tokens each (greedy, ignore_eos); tok/s counts every sequence. FreeToken: the engine
(CUDA graphs, prefix cache on, prefill in 2048-token chunks) runs the B prompts once, then the
same B again, timed: the prefix cache serves all but the last page of each, so the B sequences
start decoding in the same step and tok/s = B (gen - 1) / (last token - last first token)
(benchmarks/gpu_offload.py's decode). The row keeps cached_share, the share of those pages the
cache served in the timed run (below 1: it prefilled too, and the figure is not clean).
llama.cpp: `llama-bench -p 0 -n GEN -d D -ngl 99 -fa 1` at batch 1, `llama-batched-bench -npp D
-ntg GEN -npl B -c B(D+GEN)+256 -fa on` (its S_TG) above, both with -b/-ub 2048 for the untimed
prompt; their JSON lines are parsed by benchmarks/llama_cpp_cuda/bench.py's parsers.

Ceiling of a decode row = B x bandwidth / bytes, the bandwidth that of a device-to-device copy
measured at the start of the run (benchmarks/gpu_decode.py) and bytes what one step reads:
the file's weights (benchmarks/step_bytes.py: every tensor but the embedding table; the routed
experts of a MoE layer as the E (1 - (1 - k/E)^B) of E that B tokens reach under uniform
routing) + B x the context of one sequence at D + GEN/2 positions (K and V of every
full-attention layer, 2 bytes an element; each Gated DeltaNet layer's float32 state and conv
window, read and written). share = FreeToken / ceiling.

Prefill row (shape, P): one prompt of P tokens. FreeToken's time to the first token (prefix
cache off; median of 3 after a warm-up), tok/s = P / TTFT; llama.cpp's `llama-bench -p P -n 0
-ngl 99 -fa 1 -ub 2048 -b 2048` (mean of 3). ratio = FreeToken / llama.cpp.

A row whose KV (B (D + GEN) tokens, step_bytes' formula) does not fit in what the GPU has free
after FreeToken's weights, less 4 GiB for work buffers, is skipped saying so. llama.cpp comes from
$LCPP_HOME as for gpu_vs_llamacpp.py (`python -m benchmarks.llama_cpp_cuda build`; --wait-peer
S waits for one running); without it its columns say why and FreeToken's rows still run.
--results FILE is read first and updated (the engines may run in separate calls, --work DIR
keeping the files between them).

Goals: faster than llama.cpp at every depth; batch-1 decode at 64k at >= 70% of the ceiling;
128k prefill at least llama.cpp's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_decode, gpu_quant_rows, gpu_vs_llamacpp, step_bytes  # noqa: E402
from benchmarks.gpu_speculative import distinct_experts, numbers  # noqa: E402

BF16_SHAPES = ("qwen3-8b", "qwen3.6-35b-a3b")
SHAPES = BF16_SHAPES + tuple(f"{s}-q4km" for s in BF16_SHAPES)
ENGINES = ("freetoken", "llama.cpp")
CHUNK = 2048            # prompt tokens a step: FreeToken's max_prefill_tokens, llama.cpp's -b/-ub
REPS = 3
PAGE = 16               # the engine's KV page: one spare page a sequence
GIB = 1 << 30
MARGIN = 4 * GIB        # beside the KV: work buffers, graphs, logits
GOAL_DEPTH, GOAL_SHARE, GOAL_PREFILL = 65536, 0.70, 131072


# ---- arithmetic ---------------------------------------------------------------------------------

def kv_bytes(config: dict, tokens: int, kv_item: float = step_bytes.KV_ITEM) -> float:
    """K and V of `tokens` positions in every full-attention layer (step_bytes' formula)."""
    return (step_bytes.context_bytes(config, tokens, kv_item)
            - step_bytes.context_bytes(config, 0, kv_item))


def step_read_bytes(weights: dict, config: dict, batch: int, context: int,
                    kv_item: float = step_bytes.KV_ITEM) -> float:
    """Bytes one decode step of `batch` sequences at `context` positions each reads. `weights`:
    step_bytes' {"weights", "experts"} of the file (routed experts counted at k of E)."""
    routed = weights["experts"]
    if routed:
        cfg = argparse.Namespace(**step_bytes.text_config(config))
        routed = routed / cfg.num_experts_per_tok * distinct_experts(batch, cfg)
    return (weights["weights"] - weights["experts"] + routed
            + batch * step_bytes.context_bytes(config, context, kv_item))


def ceiling_tok_s(weights: dict, config: dict, batch: int, depth: int, gen: int,
                  bandwidth: float, kv_item: float = step_bytes.KV_ITEM) -> float:
    return batch * bandwidth / step_read_bytes(weights, config, batch, depth + gen // 2, kv_item)


def row_tokens(row: dict, gen: int) -> int:
    """KV pool tokens a row needs."""
    if row["kind"] == "decode":
        return row["batch"] * (row["depth"] + gen + PAGE)
    return row["prompt"] + PAGE


def row_kv_item(config: dict, row: dict) -> float:
    return step_bytes.kv_item_bytes(config, row.get("kv_dtype", "auto"))


def too_big(config: dict, row: dict, gen: int, free: int) -> str | None:
    """Why the row's KV does not fit in `free` bytes, or None."""
    need = kv_bytes(config, row_tokens(row, gen), row_kv_item(config, row))
    if need + MARGIN <= free:
        return None
    return (f"the KV of {row_tokens(row, gen)} tokens is {need / GIB:.1f} GiB; "
            f"{free / GIB:.1f} GiB free after the weights, {MARGIN // GIB} GiB kept for buffers")


# ---- FreeToken ----------------------------------------------------------------------------------

def decode_row(engine, row: dict, gen: int, vocab: int) -> dict:
    from benchmarks.gpu_offload import decode

    batch, depth = row["batch"], row["depth"]
    decode(engine, batch, depth, gen)      # prefills the prompts; their pages stay cached
    before = engine.stats()
    tok_s = decode(engine, batch, depth, gen)
    after = engine.stats()
    if failed := after["requests_finished_error"] - before["requests_finished_error"]:
        return {"skipped": f"FreeToken: {failed} of {batch} requests ended in an error"}
    cached = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    cacheable = batch * ((depth - 1) // PAGE * PAGE)     # the last token is always computed
    return {"tok_s": tok_s, "cached_share": round(cached / cacheable, 4) if cacheable else 1.0}


def prefill_row(engine, row: dict, gen: int, vocab: int) -> dict:
    from freetoken.cli.bench import _batch

    ttfts = [asyncio.run(_batch(engine, 1, row["prompt"], 1, vocab))["ttft_s"]
             for _ in range(1 + REPS)]
    ttft = statistics.median(ttfts[1:])
    return {"ttft_s": ttft, "tok_s": row["prompt"] / ttft}


def freetoken(source: str, config: dict, gen: int, rows: list[dict]) -> dict:
    """Fill each row's "freetoken" cell: one engine for the decode rows, one for the prefill
    rows, each with a KV pool for the largest of its rows that fits."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model

    loaded = load_model(source, device="cuda")
    try:
        for kind, run in (("decode", decode_row), ("prefill", prefill_row)):
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info()[0]
            todo = []
            for row in (r for r in rows if r["kind"] == kind):
                if why := too_big(config, row, gen, free):
                    row["freetoken"] = {"skipped": why}
                    print(f"  {row['key']}: FreeToken skipped: {why}", flush=True)
                else:
                    todo.append(row)
            if not todo:
                continue
            settings = EngineConfig(num_tokens=max(row_tokens(r, gen) for r in todo) + 256,
                                    max_num_seqs=max(r.get("batch", 1) for r in todo),
                                    max_prefill_tokens=CHUNK, device="cuda",
                                    kv_dtype=todo[0].get("kv_dtype", "auto"),
                                    prefix_cache=kind == "decode")
            engine = Engine.from_loaded(loaded, settings).start()
            try:
                engine.warm_up()
                for row in todo:
                    row["freetoken"] = run(engine, row, gen, loaded.config.vocab_size)
                    print(f"  {row['key']}: FreeToken {json.dumps(row['freetoken'])}", flush=True)
            finally:
                engine.shutdown()
            del engine
    finally:
        del loaded
        gc.collect()
        torch.cuda.empty_cache()
    return {}


# ---- llama.cpp ----------------------------------------------------------------------------------

def commands(gguf: Path, rows: list[dict], gen: int) -> list[tuple[list[dict], list[str]]]:
    """(rows, the tool run that measures them): per depth llama-bench for batch 1 and one
    llama-batched-bench for the larger batches; one llama-bench for every prefill length."""
    from benchmarks.llama_cpp_cuda.paths import tool

    model = ["-m", str(gguf), "-ngl", "99", "-b", str(CHUNK), "-ub", str(CHUNK)]
    if any(r.get("kv_dtype") == "fp8" for r in rows):
        model += ["-ctk", "q8_0", "-ctv", "q8_0"]     # its nearest 8-bit cache
    runs = []
    for depth in sorted({r["depth"] for r in rows if r["kind"] == "decode"}):
        at = [r for r in rows if r["kind"] == "decode" and r["depth"] == depth]
        if one := [r for r in at if r["batch"] == 1]:
            runs.append((one, [str(tool("llama-bench")), *model, "-fa", "1", "-p", "0",
                               "-n", str(gen), "-d", str(depth), "-r", str(REPS),
                               "-o", "jsonl"]))
        if many := [r for r in at if r["batch"] > 1]:
            batches = sorted(r["batch"] for r in many)
            runs.append((many, [str(tool("llama-batched-bench")), *model, "-fa", "on",
                                "-c", str(batches[-1] * (depth + gen) + 256), "-npp", str(depth),
                                "-ntg", str(gen), "-npl", ",".join(map(str, batches)),
                                "--output-format", "jsonl"]))
    if prefills := [r for r in rows if r["kind"] == "prefill"]:
        runs.append((prefills, [str(tool("llama-bench")), *model, "-fa", "1", "-p",
                                ",".join(str(r["prompt"]) for r in prefills), "-n", "0",
                                "-r", str(REPS), "-o", "jsonl"]))
    return runs


def llamacpp(gguf: Path, rows: list[dict], gen: int) -> None:
    """Fill each row's "llama.cpp" cell from the tools' JSON lines (llama_cpp_cuda.bench's
    parsers): {"tok_s"} or {"skipped": the tool's exit status and last lines}."""
    from benchmarks.llama_cpp_cuda.bench import parse_batched, parse_bench, run_tool

    for measured, command in commands(gguf, rows, gen):
        code, text, _ = run_tool(command)
        figures = {**parse_bench(text), **parse_batched(text)}
        tail = " | ".join([ln for ln in text.splitlines() if ln.strip()][-2:])
        for row in measured:
            key = f"prefill{row['prompt']}" if row["kind"] == "prefill" else \
                f"decode_bs{row['batch']}"
            row["llama.cpp"] = {"tok_s": figures[key]} if figures.get(key) else \
                {"skipped": f"{Path(command[0]).name} exit {code}: {tail}"}
            print(f"  {row['key']}: llama.cpp {json.dumps(row['llama.cpp'])}", flush=True)


def llamacpp_side(gguf: Path, folder: Path | None, rows: list[dict], gen: int, peer,
                  keep: bool) -> None:
    """llama.cpp on `gguf`, converted from the bf16 `folder` first when given (and deleted
    after unless `keep`); every cell says why when it cannot run."""
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.convert import convert

    why = peer.reason()
    try:
        if why is None and folder is not None and not gguf.is_file():
            convert(folder, gguf, "bf16", peer.staged)
        if why is None:
            llamacpp(gguf, rows, gen)
    except (paths.PeerUnavailable, RuntimeError) as exc:
        why = str(exc)
    finally:
        if folder is not None and not keep:
            gguf.unlink(missing_ok=True)
    for row in rows if why else ():
        row["llama.cpp"] = {"skipped": why}


# ---- one shape ----------------------------------------------------------------------------------

def stretch(folder: Path, positions: int) -> None:
    """Raise config.json's max_position_embeddings to `positions` (both engines refuse longer
    prompts); plain RoPE, so the weights stay as they are."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if config.get("max_position_embeddings", 0) < positions:
        config["max_position_embeddings"] = positions
        path.write_text(json.dumps(config, indent=2))


def measure(shape: str, work: Path, args, bandwidth: float, rows: list[dict], later: list[str],
            peer) -> None:
    positions = max(args.depths + args.prefills) + args.gen + PAGE

    def build(base: str, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        gpu_vs_llamacpp.build_shape(base, folder, 0)
        stretch(folder, positions)

    quant = gpu_quant_rows.ROWS.get(shape)
    if quant is not None:
        artifact: Path | str = quant.artifact(work)
        if (work / quant.base / "config.json").is_file():    # a folder of an earlier call
            stretch(work / quant.base, positions)
        if not artifact.exists() and (why := peer.reason()):
            artifact = f"the row's file comes from llama-quantize: {why}"
        elif not artifact.exists():
            artifact = gpu_quant_rows.make_artifact(quant, work, build, later, args.peer)
        if isinstance(artifact, str):
            for row in rows:
                row.update({engine: {"skipped": artifact} for engine in args.engines})
            return
        source, folder, config = artifact, None, json.loads(
            (work / f"{quant.base}.config.json").read_text())
        gguf = artifact
    else:
        source = folder = work / shape
        if not (folder / "config.json").is_file():
            build(shape, folder)
        stretch(folder, positions)
        config, gguf = json.loads((folder / "config.json").read_text()), \
            work / f"{shape}.bf16.gguf"
    weights = step_bytes.gguf_weight_bytes(source) if quant else \
        step_bytes.safetensors_weight_bytes(source)
    for row in rows:
        if row["kind"] == "decode":
            item = row_kv_item(config, row)
            row["step_bytes"] = step_read_bytes(weights, config, row["batch"],
                                                row["depth"] + args.gen // 2, item)
            row["ceiling_tok_s"] = ceiling_tok_s(weights, config, row["batch"], row["depth"],
                                                 args.gen, bandwidth, item)
    keep_folder, keep_gguf = gpu_quant_rows.needed_later(
        gpu_quant_rows.QuantRow(shape, shape, "bf16"), later, work)
    if "llama.cpp" in args.engines:
        llamacpp_side(gguf, folder, rows, args.gen, peer, keep_gguf)
    if "freetoken" in args.engines:
        for row in rows:
            row.pop("freetoken", None)
        failed = gpu_quant_rows.freetoken_row(
            source, args.gen, lambda src, gen: freetoken(src, config, gen, rows))
        for row in rows:
            row.setdefault("freetoken", failed or {"skipped": "not measured"})
    if args.work is None and quant is not None:
        artifact.unlink(missing_ok=True)
    elif args.work is None and not keep_folder:
        shutil.rmtree(folder, ignore_errors=True)


# ---- report -------------------------------------------------------------------------------------

def _label(row: dict) -> str:
    return row["shape"] + (f" kv-{row['kv_dtype']}" if row.get("kv_dtype") else "")


def _tok_s(cell: dict | None) -> float | None:
    return (cell or {}).get("tok_s")


def _fmt(value, width: int, fmt: str = "{:,.1f}") -> str:
    return f"{'-' if value is None else fmt.format(value):>{width}}"


def goals(rows: list[dict]) -> list[str]:
    decode = [r for r in rows if r["kind"] == "decode"]
    pairs = [r for r in decode if _tok_s(r.get("freetoken")) and _tok_s(r.get("llama.cpp"))]
    behind = [r["key"] for r in pairs if _tok_s(r["freetoken"]) < _tok_s(r["llama.cpp"])]
    lines = ["faster than llama.cpp at every depth: "
             + ("not measured" if not pairs else "yes" if not behind
                else "no: " + ", ".join(behind))]
    for r in decode:
        if r["batch"] == 1 and r["depth"] == GOAL_DEPTH and _tok_s(r.get("freetoken")):
            share = _tok_s(r["freetoken"]) / r["ceiling_tok_s"]
            lines.append(f"{_label(r)} batch 1 at {GOAL_DEPTH}: {100 * share:.0f}% of the "
                         f"ceiling (goal >= {100 * GOAL_SHARE:.0f}%)")
    for r in rows:
        if r["kind"] == "prefill" and r["prompt"] == GOAL_PREFILL:
            a, b = _tok_s(r.get("freetoken")), _tok_s(r.get("llama.cpp"))
            lines.append(f"{_label(r)} prefill {GOAL_PREFILL}: "
                         + (f"{a / b:.2f}x llama.cpp (goal >= 1)" if a and b else "not measured"))
    return lines


def report(rows: list[dict], bandwidth: float) -> None:
    print(f"\nD2D bandwidth {bandwidth / 1e12:.2f} TB/s; decode tok/s counts every sequence")
    print(f"{'shape':22}{'batch':>6}{'depth':>8}{'FreeToken':>11}{'llama.cpp':>11}{'ratio':>7}"
          f"{'ceiling':>11}{'share':>7}")
    reasons: dict[str, list[str]] = {}
    for r in rows:
        for engine in ENGINES:
            if why := (r.get(engine) or {}).get("skipped"):
                reasons.setdefault(f"{engine}: {why}", []).append(r["key"])
        if r["kind"] != "decode":
            continue
        a, b = _tok_s(r.get("freetoken")), _tok_s(r.get("llama.cpp"))
        ceiling = r.get("ceiling_tok_s")
        print(f"{_label(r):22}{r['batch']:6d}{r['depth']:8d}{_fmt(a, 11)}{_fmt(b, 11)}"
              f"{_fmt(a / b if a and b else None, 7, '{:.2f}')}{_fmt(ceiling, 11, '{:,.0f}')}"
              f"{_fmt(100 * a / ceiling if a and ceiling else None, 7, '{:.0f}%')}")
    print(f"\n{'shape':22}{'prompt':>8}{'FT TTFT s':>11}{'FT tok/s':>11}{'llama.cpp':>11}"
          f"{'ratio':>7}")
    for r in (r for r in rows if r["kind"] == "prefill"):
        ours = r.get("freetoken") or {}
        a, b = _tok_s(ours), _tok_s(r.get("llama.cpp"))
        print(f"{_label(r):22}{r['prompt']:8d}{_fmt(ours.get('ttft_s'), 11, '{:.3f}')}"
              f"{_fmt(a, 11, '{:,.0f}')}{_fmt(b, 11, '{:,.0f}')}"
              f"{_fmt(a / b if a and b else None, 7, '{:.2f}')}")
    for why, keys in reasons.items():
        print(f"skipped ({', '.join(keys) if len(keys) < 4 else f'{len(keys)} rows'}): {why}")
    print("\n" + "\n".join(goals(rows)))


# ---- main ---------------------------------------------------------------------------------------

def _sizes(text: str, flag: str, empty_ok: bool = True) -> list[int]:
    values = numbers(text, int, flag) if text.strip() or not empty_ok else []
    if any(v < 1 for v in values):
        raise SystemExit(f"{flag}: values of at least 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(BF16_SHAPES),
                   help=f"comma-separated, of {','.join(SHAPES)}")
    p.add_argument("--depths", default="4096,16384,32768,65536,131072",
                   help="prompt tokens before the timed decode, comma-separated")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--prefills", default="32768,131072",
                   help="prompt lengths of the prefill rows, comma-separated")
    p.add_argument("--gen", type=int, default=64, help="decode tokens timed per request")
    p.add_argument("--engines", default="freetoken,llama.cpp")
    p.add_argument("--kv-dtype", default="auto",
                   help="FreeToken's KV pool (fp8: llama.cpp runs -ctk/-ctv q8_0 beside it)")
    p.add_argument("--results", type=Path, default=None,
                   help="JSON of every row, read first and updated")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the models, kept and reused (default: a temp dir)")
    p.add_argument("--peer", type=Path, default=None,
                   help="the staged llama.cpp folder (default .carry/llama-cpp)")
    p.add_argument("--wait-peer", type=float, default=0.0,
                   help="seconds to wait for a llama.cpp build running in the background")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    if not args.shapes or any(s not in SHAPES for s in args.shapes):
        raise SystemExit(f"--shapes: comma-separated values among {', '.join(SHAPES)}, "
                         f"got {','.join(args.shapes)!r}")
    args.engines = {e for e in args.engines.split(",") if e}
    if not args.engines or args.engines - set(ENGINES):
        raise SystemExit("--engines: freetoken, llama.cpp or both, comma-separated")
    if args.kv_dtype not in ("auto", "fp8"):
        raise SystemExit(f"--kv-dtype: auto or fp8, got {args.kv_dtype!r}")
    args.depths = _sizes(args.depths, "--depths")
    args.batch_sizes = _sizes(args.batch_sizes, "--batch-sizes", empty_ok=False)
    args.prefills = _sizes(args.prefills, "--prefills")
    if not args.depths and not args.prefills:
        raise SystemExit("--depths, --prefills: nothing to measure")
    if args.gen < 2:
        raise SystemExit("--gen: at least 2 tokens (the first comes with the prompt)")
    return args


def shape_rows(shape: str, args) -> dict[str, dict]:
    rows = {}
    kv = {} if args.kv_dtype == "auto" else {"kv_dtype": args.kv_dtype}
    tag = "" if args.kv_dtype == "auto" else f" kv-{args.kv_dtype}"
    for depth in args.depths:
        for batch in args.batch_sizes:
            rows[f"{shape} bs{batch} d{depth}{tag}"] = dict(
                shape=shape, kind="decode", batch=batch, depth=depth, gen=args.gen, **kv)
    for prompt in args.prefills:
        rows[f"{shape} prefill {prompt}{tag}"] = dict(shape=shape, kind="prefill",
                                                      prompt=prompt, **kv)
    return rows


def main() -> None:
    args = parse_args()
    results: dict = {"rows": {}}
    if args.results is not None and args.results.is_file():
        try:
            results = json.loads(args.results.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            results = {"error": str(exc)}
        if not isinstance(results, dict) or not isinstance(results.get("rows"), dict):
            raise SystemExit(f"--results {args.results}: not this script's JSON; pass a new "
                             f"file")
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    peer = gpu_vs_llamacpp.Peer(args.peer, args.wait_peer)
    bandwidth, start = gpu_decode.d2d_bandwidth(), time.perf_counter()
    torch.cuda.empty_cache()
    results["bandwidth_Bps"] = bandwidth
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    asked = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = args.work or Path(tmp)
        for i, shape in enumerate(args.shapes):
            rows = []
            for key, fields in shape_rows(shape, args).items():
                rows.append(results["rows"].setdefault(key, {}))
                rows[-1].update(fields, key=key)
            print(f"\n== {shape} ==", flush=True)
            measure(shape, work, args, bandwidth, rows, args.shapes[i + 1:], peer)
            asked += rows
            if args.results is not None:
                args.results.parent.mkdir(parents=True, exist_ok=True)
                args.results.write_text(json.dumps(results, indent=1, default=str))
    report(asked, bandwidth)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
