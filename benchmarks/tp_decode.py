"""Tensor parallelism on two GPUs: TP=1 against TP=2, beside llama.cpp's two-GPU split modes.

    python benchmarks/tp_decode.py [--shapes qwen3-8b,qwen3-30b-a3b] [--peer DIR] [--gen 128]

Per shape (the random bf16 folders of gpu_vs_llamacpp.py: Qwen3-8B at 8 layers, Qwen3-30B-A3B
at 12 layers): FreeToken through the engine (CUDA graphs, NCCL all-reduces captured in them) at
TP=1 on GPU 0 and TP=2 on GPUs 0,1, decode tok/s at batch 1 and 32 and prefill tok/s at 2048
tokens; llama.cpp (benchmarks/llama_cpp_cuda: the sources `stage` packed, `--peer DIR`, default
.carry/llama-cpp, and a build in $LCPP_HOME) on the same folder converted to bf16 GGUF, with
`-sm layer` and `-sm row` over both GPUs. Goal: TP=2 batch-1 decode >= 1.6x TP=1 on the 8B
shape. With fewer than two GPUs it says so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = ("qwen3-8b", "qwen3-30b-a3b")
BATCHES = (1, 32)
PREFILL = 2048


def freetoken(folder: str, size: int, gen: int) -> dict:
    """Decode tok/s at each batch and prefill tok/s at PREFILL, at `size` ranks."""
    import torch

    from freetoken.cli.bench import _batch
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.parallel.options import ParallelConfig
    from freetoken.parallel.start import start_sharded

    if size == 1:
        loaded = load_model(folder, device="cuda:0")
    else:
        loaded = start_sharded(folder, "auto",
                               ParallelConfig(size, tuple(f"cuda:{i}" for i in range(size))))
    need = max(max(BATCHES) * (128 + gen), PREFILL + 16)
    config = EngineConfig(num_tokens=need + 256, max_num_seqs=max(BATCHES),
                          max_prefill_tokens=PREFILL, device="cuda:0", prefix_cache=False,
                          overlap=size == 1)
    engine = Engine.from_loaded(loaded, config).start()
    vocab, out = loaded.config.vocab_size, {}
    try:
        engine.warm_up()
        asyncio.run(_batch(engine, 1, 16, 4, vocab))   # settle allocations and graphs
        out[f"prefill{PREFILL}"] = PREFILL / asyncio.run(
            _batch(engine, 1, PREFILL, 1, vocab))["ttft_s"]
        for b in BATCHES:
            out[f"decode_bs{b}"] = asyncio.run(_batch(engine, b, 128, gen, vocab))["decode_tok_s"]
    finally:
        engine.shutdown()
        if hasattr(loaded.model, "close"):
            loaded.model.close()
    del engine, loaded
    torch.cuda.empty_cache()
    return out


def llamacpp(folder: Path, work: Path, peer: Path | None) -> dict:
    """{split mode: figures} of llama.cpp over GPUs 0,1, or {"skipped": why}."""
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.convert import convert

    gguf = work / f"{folder.name}.gguf"
    try:
        bench = paths.tool("llama-bench")
        batched = paths.tool("llama-batched-bench")
        convert(folder, gguf, "bf16", peer)
    except (paths.PeerUnavailable, RuntimeError) as exc:
        return {"skipped": str(exc)}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    out = {}
    for mode in ("layer", "row"):
        figures = {}
        run = subprocess.run([str(bench), "-m", str(gguf), "-ngl", "99", "-fa", "1", "-r", "3",
                              "-sm", mode, "-p", str(PREFILL), "-n", "128", "-o", "jsonl"],
                             capture_output=True, text=True, env=env)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                d = json.loads(line)
                figures["decode_bs1" if d["n_gen"] else f"prefill{PREFILL}"] = d["avg_ts"]
        run_b = subprocess.run([str(batched), "-m", str(gguf), "-ngl", "99", "-fa", "on",
                                "-sm", mode, "-c", "12288", "-npp", "128", "-ntg", "128",
                                "-npl", "32"], capture_output=True, text=True, env=env)
        for line in run_b.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 10 and cells[2] == "32":
                figures["decode_bs32"] = float(cells[7])
        if run.returncode:
            figures["error"] = run.stderr[-300:]
        out[mode] = figures
    gguf.unlink(missing_ok=True)
    return out


def report(name: str, tp1: dict, tp2: dict, peer: dict) -> None:
    print(f"\n== {name} ==")
    modes = [] if "skipped" in peer else list(peer)
    if "skipped" in peer:
        print(f"llama.cpp: skipped: {peer['skipped']}")
    head = f"{'':22}{'TP=1':>10}{'TP=2':>10}{'TP2/TP1':>9}"
    print(head + "".join(f"{'lcpp ' + m:>12}" for m in modes))
    for key in [f"decode_bs{b}" for b in BATCHES] + [f"prefill{PREFILL}"]:
        a, b = tp1.get(key), tp2.get(key)
        ratio = f"{b / a:9.2f}" if a and b else f"{'-':>9}"
        peers = "".join(f"{peer[m].get(key, float('nan')):12.1f}" for m in modes)
        print(f"{key + ' (tok/s)':22}{a or float('nan'):10.1f}{b or float('nan'):10.1f}"
              f"{ratio}{peers}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--peer", type=Path, default=None,
                   help="the staged llama.cpp folder (python -m benchmarks.llama_cpp_cuda stage; "
                        "default .carry/llama-cpp)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--gen", type=int, default=128)
    args = p.parse_args()
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print(f"tp_decode: skipped: needs two GPUs, torch sees {count}")
        return
    from benchmarks.gpu_vs_llamacpp import build_shape

    shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES]:
        raise SystemExit(f"--shapes: unknown {', '.join(bad)}; known: {', '.join(SHAPES)}")
    results = {}
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for name in shapes:
            folder = Path(tmp) / name
            folder.mkdir()
            build_shape(name, folder, 128 + args.gen // 2)
            peer = llamacpp(folder, Path(tmp), args.peer)
            tp1 = freetoken(str(folder), 1, args.gen)
            tp2 = freetoken(str(folder), 2, args.gen)
            report(name, tp1, tp2, peer)
            results[name] = {"tp1": tp1, "tp2": tp2, "llama.cpp": peer}
            subprocess.run(["rm", "-rf", str(folder)], check=False)
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
