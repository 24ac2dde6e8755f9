"""Experts beyond VRAM: FreeToken's expert cache at several cache rates on a Qwen3-30B-A3B-shaped
MoE, with the pinned host-to-device bandwidth measured in the same run, beside transformers'
own offload (device_map across GPU and CPU).

    python benchmarks/gpu_offload.py [--layers 12] [--gen 32] [--rates 1.0,0.5,0.2,0.1]

The model of benchmarks/gpu_moe.py (random bf16, hidden 2048, 128 experts of width 768, 8 per
token), `--layers` of its 48. Routing is replaced by a synthetic trace so the cache sees a
known distribution: `uniform` (fresh pseudo-random logits every token and layer: the worst case
for a cache) and `skewed` (a fixed popularity per layer, logit bias -1.2 ln(rank), plus the
same unit-variance noise: a few experts take most tokens, as real traces do); the noise is a
function of the hidden state, so decode CUDA graphs capture the router (TraceRouter). Rate 1.0
is the resident model (every expert on the GPU, decode in CUDA graphs, the model's own
router); lower rates load the experts into pinned host memory and resize one engine's cache
live (`resize_pools`) from rate to rate. For each rate, batch and trace: decode tok/s, the
expert hit rate, the miss bytes per token and the miss traffic as a share of the measured H2D
bandwidth (goal at 0.2: >= 70%), copy-only (decode graph segments) vs co-execution (eager
steps; the CPU policy on: measured PCIe and CPU speeds decide per step); then the offloaded
engine at rate 1 after warming (every expert cached: the cost of the graph segments, one id
copy and sync per MoE layer, beside the resident row). transformers' row needs
`accelerate`; without it the row is skipped with a message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_moe import build  # noqa: E402


class TraceRouter:
    """Stands in for a MoE layer's router linear: writes synthetic logits [T, E] = a fixed
    popularity bias (skewed; none for uniform) + noise. The noise is a pseudo-random function
    of the token's hidden state: the mean of 4 terms sqrt(2) sin(64 x @ P_j) for random
    P_j [H, E], near Gaussian with unit variance and fresh for every token and layer as hidden
    states differ, so the router stays a pure device computation that decode CUDA graphs
    capture."""

    TERMS = 4

    def __init__(self, num_experts: int, hidden: int, layer: int, mode: str):
        g = torch.Generator(device="cuda").manual_seed(1000 + layer)
        rank = torch.randperm(num_experts, generator=g, device="cuda").float() + 1.0
        self.bias = -1.2 * torch.log(rank)               # Zipf-like popularity, in logits
        if mode == "uniform":
            self.bias.zero_()
        self.e = num_experts
        self.proj = torch.randn(hidden, self.TERMS * num_experts, generator=g, device="cuda")

    def __call__(self, out, x) -> None:
        waves = torch.sin(64.0 * (x.float() @ self.proj)).view(-1, self.TERMS, self.e)
        noise = waves.sum(1) * (2.0 / self.TERMS) ** 0.5
        out.copy_((self.bias + noise).to(out.dtype))


def set_trace(engine, mode: str) -> None:
    """Route every MoE layer of the engine's model by `mode` (uniform, skewed, or model: its
    own router), recapturing the decode graphs so they replay the new router.
    NOTE: call between requests (the engine thread is idle then)."""
    from freetoken.engine.offload_setup import moe_layers

    model = engine.model
    for index, mlp in enumerate(moe_layers(model)):
        if not hasattr(mlp, "_real_router"):
            mlp._real_router = mlp.router
            # the small-step decode's own router GEMV (moe_decode_quant) reads the weights
            # directly: without it, it calls the layer's router, which the trace replaces
            mlp._real_decode_router = getattr(mlp.decode, "router", None)
        mlp.router = mlp._real_router if mode == "model" else TraceRouter(
            model.config.moe.num_experts, model.config.hidden_size, index, mode)
        if mlp.decode is not None and hasattr(mlp.decode, "router"):
            mlp.decode.router = mlp._real_decode_router if mode == "model" else None
    if engine.graphs is not None:
        engine.graphs = engine.recapture_graphs()


def decode(engine, batch: int, prompt: int, gen: int) -> float:
    """Decode tok/s of `batch` concurrent greedy requests (first token to last)."""
    from freetoken.engine.request import SamplingParams

    firsts, lasts = [], []

    async def one(i):
        ids = [(13 * i + j) % 200 + 10 for j in range(prompt)]
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        first = None
        async for _ in engine.generate(ids, params):
            now = time.perf_counter()
            first = first or now
        firsts.append(first)
        lasts.append(now)

    async def run():
        await asyncio.gather(*(one(i) for i in range(batch)))

    asyncio.run(run())
    return batch * (gen - 1) / (max(lasts) - max(firsts))


def measure(engine, batch, args, h2d: float) -> dict:
    before = engine.stats()
    t = time.perf_counter()
    tok_s = decode(engine, batch, args.prompt, args.gen)
    wall = time.perf_counter() - t
    after = engine.stats()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in
         ("expert_hits", "expert_misses", "expert_bytes_h2d", "expert_cpu_executed",
          "tokens_generated")}
    looked = d["expert_hits"] + d["expert_misses"]
    # decode copies only: prefill's staged layers and CPU-computed misses are not counted
    copied = d["expert_misses"] - d["expert_cpu_executed"]
    decode_bytes = copied * engine.expert_cache.expert_bytes if engine.expert_cache else 0
    decode_s = batch * (args.gen - 1) / tok_s
    return {"batch": batch, "decode_tok_s": round(tok_s, 1),
            "hit_rate": round(d["expert_hits"] / looked, 3) if looked else 1.0,
            "miss_bytes_per_token": int(decode_bytes / max(d["tokens_generated"], 1)),
            "miss_traffic_share_of_h2d": round(decode_bytes / decode_s / h2d, 3)
            if decode_bytes else 0.0,
            "cpu_experts": d["expert_cpu_executed"], "wall_s": round(wall, 2)}


def freetoken_rows(folder: str, args, h2d: float) -> list[dict]:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.models.loader import load_model

    rates = [float(r) for r in args.rates.split(",")]
    config = EngineConfig(num_tokens=16384, max_num_seqs=max(args.batches), device="cuda")
    rows = []

    def run_all(engine, rate, label, traces=("uniform", "skewed")):
        for mode in traces:
            set_trace(engine, mode)
            decode(engine, 1, args.prompt, 4)              # warm the cache for this trace
            for batch in args.batches:
                row = dict(rate=rate, trace=mode, mode=label, **measure(engine, batch, args, h2d))
                print(json.dumps(row), flush=True)
                rows.append(row)

    if 1.0 in rates:
        engine = Engine.from_loaded(load_model(folder, device="cuda"), config).start()
        # with no cache, routing barely matters: the model's own router
        run_all(engine, 1.0, "resident", traces=("model",))
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    low = [r for r in rates if r < 1.0]
    if not low:
        return rows
    loaded = load_model(folder, device="cuda", plan=lambda cfg, dtype, weights: True)
    decision = OffloadDecision(low[0], 16384, None, None, cpu=True)
    engine = Engine.from_loaded(loaded, config, decision).start()
    policy = engine.expert_cache.policy
    t = policy.throughput
    print(f"policy inputs: H2D {t.h2d_bytes_per_s / 1e9:.1f} GB/s, CPU expert "
          f"{t.cpu_bytes_per_s / 1e9:.1f} GB/s, {t.cpu_flops / 1e9:.0f} GFLOP/s", flush=True)
    for rate in low:
        engine.resize_pools(moe_rate=rate)
        engine.expert_cache.policy = None
        run_all(engine, rate, "copy-only")
        engine.expert_cache.policy = policy
        run_all(engine, rate, "co-exec")
    # The cost of the offloaded step itself (decode graph segments, one id copy and sync per
    # MoE layer) beside the resident row: every expert cached, so (after warming) nothing
    # misses.
    engine.resize_pools(moe_rate=1.0)
    engine.expert_cache.policy = None
    set_trace(engine, "uniform")
    decode(engine, max(args.batches), args.prompt, 64)
    run_all(engine, 1.0, "offload-all-hit", traces=("uniform",))
    engine.shutdown()
    return rows


def transformers_row(folder: str, args, gpu_bytes: int) -> dict:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return {"skipped": "transformers' device_map offload needs `accelerate` "
                           "(pip install accelerate)"}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="auto",
        max_memory={0: gpu_bytes, "cpu": 400 << 30}).eval()
    ids = torch.randint(10, 200, (1, args.prompt), device="cuda")
    kwargs = dict(max_new_tokens=args.hf_gen, min_new_tokens=args.hf_gen, do_sample=False)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    on_gpu = sum(1 for d in model.hf_device_map.values() if d == 0)
    return {"decode_bs1_tok_s": round(args.hf_gen / (time.perf_counter() - t), 2),
            "gpu_budget_bytes": gpu_bytes, "modules_on_gpu": on_gpu,
            "modules": len(model.hf_device_map)}


def main() -> None:
    from freetoken.engine.offload_policy import measure_h2d

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--hf-gen", type=int, default=8)
    p.add_argument("--rates", default="1.0,0.5,0.2,0.1")
    p.add_argument("--batches", default="1,8")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    h2d = measure_h2d(torch, torch.device("cuda"), 1 << 30, repeats=5)
    print(f"pinned H2D bandwidth: {h2d / 1e9:.1f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), args.layers)
        expert_bytes = 3 * 2048 * 768 * 2 * 128 * args.layers
        other = sum(p.numel() * 2 for n, p in model.named_parameters() if "experts" not in n)
        del model
        torch.cuda.empty_cache()
        rows = freetoken_rows(tmp, args, h2d)
        torch.cuda.empty_cache()
        hf = transformers_row(tmp, args, other + int(0.2 * expert_bytes) + (2 << 30))
    print(f"transformers device_map offload (GPU budget = non-expert weights + 20% of the "
          f"experts + 2 GiB): {json.dumps(hf)}")
    print(f"\n{'rate':>5} {'trace':>8} {'mode':>10} {'batch':>5} {'tok/s':>8} {'hit':>6} "
          f"{'MB/tok':>8} {'%H2D':>6} {'cpu':>6}")
    for r in rows:
        print(f"{r['rate']:5.2f} {r['trace']:>8} {r['mode']:>10} {r['batch']:5d} "
              f"{r['decode_tok_s']:8.1f} {r['hit_rate']:6.2f} "
              f"{r['miss_bytes_per_token'] / 1e6:8.1f} "
              f"{100 * r['miss_traffic_share_of_h2d']:6.0f} {r['cpu_experts']:6d}")
    print(json.dumps({"h2d_Bps": h2d, "layers": args.layers, "rows": rows, "transformers": hf}))


if __name__ == "__main__":
    main()
