"""Where one batch-1 decode step's GPU time goes: every kernel of the captured decode graph,
grouped by name, beside the replay's wall time, so a missed speed goal comes with its
breakdown (kernel time per layer, the gaps between kernels, host time).

    python benchmarks/decode_profile.py [--shapes smollm2,qwen3-8b,...] [--work DIR] [--batch 1,8]
    python benchmarks/decode_profile.py --shapes "" --q4km-moe-layers 12 --batch 1,8

The shapes and their random-weight folders are gpu_vs_llamacpp.py's (a folder already in
--work is reused); `--q4km-moe-layers N` adds the Qwen3-30B-A3B shape written directly as a
Q4_K_M GGUF of N layers (write_gguf_moe.py, as gpu_vs_llamacpp.py's qwen3-30b-a3b-q4km row). Per shape: the engine is loaded and warmed (CUDA graphs), the graph of
`--batch` rows is replayed under torch.profiler (CUPTI records the kernels of a graph launch),
and per kernel name it prints calls per step, microseconds per call and per step, and the share
of the step. "busy" is the summed kernel time; "span" runs from the first kernel's start to the
last one's end; span - busy is the time the GPU waited between kernels of one replay (launch
latency inside the graph), and the replay's event time minus busy is everything not in a kernel.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_vs_llamacpp import SHAPES, build_shape, graph_step_ms  # noqa: E402

REPLAYS = 20


def load_engine(folder: Path, batch: int):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model

    loaded = load_model(str(folder), device="cuda")
    config = EngineConfig(num_tokens=4096, max_num_seqs=max(batch, 8), device="cuda",
                          prefix_cache=False)
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    return engine


def kernel_spans(graph) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel in REPLAYS replays of `graph`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in event.name:
            spans.append((event.name, event.time_range.start, event.time_range.end))
    return sorted(spans, key=lambda s: s[1])


def short(name: str, width: int = 70) -> str:
    name = name.replace("(anonymous namespace)::", "")
    name = name.split("(")[0].replace("void ", "").replace("freetoken::", "")
    return name if len(name) <= width else name[:width - 3] + "..."


def report(name: str, spans: list[tuple[str, float, float]], replay_ms: float | None) -> None:
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for kernel, start, end in spans:
        per_kernel[kernel].append(end - start)
    busy = sum(end - start for _, start, end in spans) / REPLAYS
    calls = len(spans) / REPLAYS
    gaps = [b[1] - a[2] for a, b in zip(spans, spans[1:]) if 0 <= b[1] - a[2] < 50]
    print(f"\n== {name} ==  {calls:.0f} kernels per step, busy {busy:.1f} us"
          + (f", replay (events) {1e3 * replay_ms:.1f} us" if replay_ms else "")
          + (f", median gap between kernels {sorted(gaps)[len(gaps) // 2]:.2f} us"
             if gaps else ""))
    print(f"{'kernel':72}{'calls':>7}{'us/call':>9}{'us/step':>9}{'share':>7}")
    rows = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
    for kernel, times in rows[:18]:
        step = sum(times) / REPLAYS
        print(f"{short(kernel):72}{len(times) / REPLAYS:7.0f}{step / (len(times) / REPLAYS):9.2f}"
              f"{step:9.1f}{100 * step / busy:6.0f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="smollm2,qwen3-8b,qwen3-30b-a3b,qwen3.6-35b-a3b")
    p.add_argument("--work", type=Path, default=None, help="folder of the models (reused)")
    p.add_argument("--batch", default="1", help="decode rows, comma-separated (1,8)")
    p.add_argument("--q4km-moe-layers", type=int, default=0,
                   help="also the Qwen3-30B-A3B shape as a Q4_K_M GGUF of this many layers")
    args = p.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in shapes if s not in SHAPES or s in ("qwen3-30b-a3b-q4km",)]:
        raise SystemExit(f"--shapes: cannot profile {', '.join(bad)}")
    try:
        batches = [int(b) for b in args.batch.split(",") if b]
    except ValueError:
        raise SystemExit(f"--batch: comma-separated row counts, got {args.batch!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch: comma-separated row counts >= 1, got {args.batch!r}")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = args.work or Path(tmp)
        models = []
        for name in shapes:
            folder = work / name
            if not (folder / "config.json").is_file():
                folder.mkdir(parents=True, exist_ok=True)
                build_shape(name, folder, 192)
            models.append((name, folder))
        if args.q4km_moe_layers > 0:
            models.append(_q4km_moe(work, args.q4km_moe_layers))
        for name, path in models:
            for batch in batches:
                _profile(f"{name} batch {batch}", path, batch)


def _q4km_moe(work: Path, layers: int) -> tuple[str, Path]:
    """The Qwen3-30B-A3B shape of `layers` layers, written directly in Q4_K_M (reused)."""
    import dataclasses

    from benchmarks import write_gguf_moe

    path = work / f"qwen3-30b-a3b-{layers}L-q4km.gguf"
    if not path.is_file():
        write_gguf_moe.write_q4_k_m(
            path, dataclasses.replace(write_gguf_moe.QWEN3_30B_A3B, layers=layers), progress=None)
    return f"qwen3-30b-a3b-q4km {layers}L", path


def _profile(title: str, path: Path, batch: int) -> None:
    engine = load_engine(path, batch)
    try:
        graphs = getattr(engine, "graphs", None)
        if graphs is None or batch not in graphs.graphs:
            print(f"\n== {title} == no decode graph of {batch} rows")
            return
        report(title, kernel_spans(graphs.graphs[batch]), graph_step_ms(engine, batch))
    finally:
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
