"""Speculative decoding on a GPU: the Qwen3.6-35B-A3B shape with its multi-token-prediction
block, decode with drafting off and with the block's drafts, beside the step's bandwidth
ceiling measured in the same run.

    python benchmarks/gpu_speculative.py [--layers 8] [--gen 128] [--batch-sizes 1,8]
        [--k 1,2,3] [--moe-cache-rate 1.0] [--routing model|uniform]
        [--modes agree,random,auto]

Random bf16 weights of the real text config (benchmarks/gpu_hybrid.py's QWEN36_35B_A3B, cut to
`--layers`) and a random MTP block of the checkpoint's layout (mtp.fc, its norms and one
full-attention MoE layer: 256 experts, 8 per token, a shared expert). Rows per batch size:

  off      plain decoding (CUDA graphs)
  agree    --speculative mtp, every draft counted accepted: the block drafts and the target
           verifies K + 1 tokens per sequence as always, then the drafts are kept whatever the
           target chose, so each step emits K + 1 tokens. This is what a block that agrees
           with the target gives (acceptance 1.0, the speed of light of MTP drafting); the
           emitted tokens are not the model's.
  random   --speculative mtp as the random block drafts (acceptance ~0, drafting backs off):
           what failing drafts cost.
  auto     --speculative auto with the random block: drafting stays on only where the engine
           measures it faster than plain decoding (engine/speculative.py's Governor).
  agree-eager, random-eager
           as agree and random with the block's steps run eagerly instead of from their CUDA
           graphs (engine/mtp_graphs.py): what the graphs save, in the same run.

`--modes` picks the rows (off always runs). Each row also gives the MTP block's wall time per
call of its step (synchronised before and after: the block over the step's new positions,
then its K - 1 draft steps) and how many of those steps replayed a graph.

Ceiling of a row: tokens per step over the bytes its step moves at the measured D2D bandwidth.
A verify step reads every non-expert weight once, the distinct routed experts of its
B * (K + 1) tokens per MoE layer (expected count under uniform routing: E * (1 - (1 - k/E)^n)),
the KV and GDN states; the block then runs K times (once over the K + 1 accepted positions,
K - 1 times over one draft token), each reading its layer, its experts and the LM head.

With a `--moe-cache-rate` below 1 (a comma-separated list runs each on the same folder) the
experts live in host memory behind an expert cache of that rate; verify steps run eagerly
through it (the largest `--k` only). The rows then say whether drafting pays at that rate (engine/speculative.py leaves
`auto` off with offloaded experts, so there are no auto rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402
from benchmarks.gpu_hybrid import QWEN36_35B_A3B, build  # noqa: E402
from benchmarks.gpu_offload import decode, measure, set_trace  # noqa: E402


def add_mtp_block(directory: Path, cfg, seed: int = 5) -> None:
    """Write random mtp.* tensors (bf16) beside the saved model and declare one MTP layer."""
    from safetensors.torch import save_file

    from tests.models.test_mtp import mtp_tensors

    tensors = {k: v.to(torch.bfloat16).contiguous()
               for k, v in mtp_tensors(cfg, "fused", seed).items()}
    save_file(tensors, str(directory / "mtp.safetensors"), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        index.write_text(json.dumps(data))
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))


def distinct_experts(tokens: int, cfg) -> float:
    """Expected distinct experts that `tokens` tokens route to under uniform routing."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens)


def step_bytes(cfg, batch: int, k: int, context: int) -> tuple[float, float]:
    """(bytes a step moves, tokens it emits) at acceptance 1.0: the verify step of
    batch * (k + 1) tokens and the MTP block's k steps; k = 0 is plain decoding."""
    item = 2
    h = cfg.hidden_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = (h * (2 * q + 2 * kv) + q * h + 2 * cfg.head_dim) * item   # + q/k norms
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = 2 * key + value
    gdn = (h * (conv + value + 2 * cfg.linear_num_value_heads) + value * h
           + conv * cfg.linear_conv_kernel_dim + cfg.linear_value_head_dim) * item
    state = 2 * (4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim
                 * cfg.linear_value_head_dim + item * conv * (cfg.linear_conv_kernel_dim - 1))
    expert = 3 * h * cfg.moe_intermediate_size * item
    # router, shared expert and its gate, the layer's two norms
    dense_moe = (cfg.num_experts * h + 3 * h * cfg.shared_expert_intermediate_size + 3 * h) * item
    head = cfg.vocab_size * h * item
    tokens = batch * (k + 1)
    total = head + 2 * h * item     # + the final norm and the embedding row
    for kind in cfg.layer_types:
        mixer = attention + 2 * kv * item * context * batch if kind == "full_attention" \
            else gdn + state * batch
        total += mixer + dense_moe + distinct_experts(tokens, cfg) * expert
    for depth in range(k):     # the block: its first step over k + 1 positions per sequence
        rows = tokens if depth == 0 else batch
        total += (2 * h * h * item + attention + 2 * kv * item * context * batch + dense_moe
                  + distinct_experts(rows, cfg) * expert + head)
    return total, tokens


def force_acceptance() -> None:
    """Every greedy draft counts accepted (the 'agree' rows)."""
    from freetoken.engine import speculative_steps

    speculative_steps.accept_greedy = lambda targets, draft: \
        [int(t) for t in draft] + [int(targets[len(draft)])]


def restore_acceptance() -> None:
    from freetoken.engine import speculative, speculative_steps

    speculative_steps.accept_greedy = speculative.accept_greedy


def time_block_steps(engine) -> dict:
    """Wrap the engine's MTP block step (engine/mtp_drafts.py: the block over the step's new
    positions, then K - 1 draft steps) to add up its GPU-synchronised wall time and calls."""
    totals: dict = {}
    if engine.mtp is None:
        return totals
    step = engine.mtp.step

    def timed(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(*args, **kwargs)
        torch.cuda.synchronize()
        totals["seconds"] = totals.get("seconds", 0.0) + time.perf_counter() - t
        totals["calls"] = totals.get("calls", 0) + 1

    engine.mtp.step = timed
    return totals


def run(folder: str, args, rate: float, sizes: list[int], ks: list[int],
        bandwidth: float) -> list[dict]:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_policy import measure_h2d
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.models.loader import load_model

    offload = rate < 1.0
    h2d = measure_h2d(torch, torch.device("cuda"), 1 << 30, repeats=5) if offload else 0.0
    loaded = load_model(folder, device="cuda",
                        plan=(lambda cfg, dtype, weights: True) if offload else None)
    assert loaded.model.mtp is not None, "the MTP block did not load"
    hf_cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg = argparse.Namespace(**{**QWEN36_35B_A3B, "layer_types": hf_cfg["layer_types"]})
    rows = []
    modes = [m for m in args.modes if not (offload and m == "auto")]
    if offload:     # each engine pins every expert afresh: the largest K only
        ks = ks[-1:]
    for mode, k in [("off", 0)] + [(m, k) for k in ks for m in modes]:
        method = {"off": "off", "auto": "auto"}.get(mode, "mtp")
        config = EngineConfig(num_tokens=16384, max_num_seqs=max(sizes), device="cuda",
                              prefix_cache=False, speculative=method,
                              num_speculative_tokens=max(k, 1))
        decision = OffloadDecision(rate, 16384, None, None, cpu=False) if offload else None
        engine = Engine.from_loaded(loaded, config, decision).start()
        if mode.startswith("agree"):
            force_acceptance()
        if mode.endswith("-eager") and engine.mtp is not None:
            engine.mtp.graphs = None
        block_time = time_block_steps(engine)
        try:
            if offload:
                set_trace(engine, args.routing)
            decode(engine, 1, args.prompt, 8)          # warm-up
            for batch in sizes:
                block_time.clear()
                before = engine.stats()
                row = measure(engine, batch, args, h2d or 1.0)
                after = engine.stats()
                drafted = after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0)
                accepted = after.get("spec_accepted_tokens", 0) - before.get(
                    "spec_accepted_tokens", 0)
                moved, emitted = step_bytes(cfg, batch, k if mode.startswith("agree") else 0,
                                            args.prompt + args.gen // 2)
                row.update(mode=mode, k=k, rate=rate, acceptance=round(accepted / drafted, 3)
                           if drafted else None,
                           auto=engine.scheduler.governor.as_dict()
                           if engine.scheduler.governor else None,
                           verify_graph_replays=getattr(engine.graphs, "verify_replays", 0),
                           block_graph_replays=getattr(engine.mtp and engine.mtp.graphs,
                                                       "replays", 0),
                           block_ms_per_call=round(1e3 * block_time["seconds"]
                                                   / block_time["calls"], 3)
                           if block_time.get("calls") else None,
                           ceiling_tok_s=round(emitted * bandwidth / moved, 1)
                           if not offload else None)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            restore_acceptance()
            engine.shutdown()
        if offload:     # a fresh cache per engine: reload
            del engine
            loaded = load_model(folder, device="cuda", plan=lambda cfg, dtype, weights: True)
    return rows


def report(rows: list[dict], args, rate: float, bandwidth: float) -> None:
    where = (f"experts offloaded at rate {rate}, {args.routing} routing"
             if rate < 1.0 else "resident")
    print(f"\n== Qwen3.6-35B-A3B shape + MTP block, {args.layers} layers, bf16, {where}; "
          f"D2D {bandwidth / 1e12:.2f} TB/s ==")
    print(f"{'batch':>5} {'mode':>12} {'K':>2} {'tok/s':>9} {'vs off':>7} {'accept':>7} "
          f"{'ceiling':>9} {'share':>6}")
    off = {r["batch"]: r["decode_tok_s"] for r in rows if r["mode"] == "off"}
    for r in sorted(rows, key=lambda r: (r["batch"], r["k"], r["mode"])):
        ceiling = r.get("ceiling_tok_s")
        share = f"{100 * r['decode_tok_s'] / ceiling:5.0f}%" if ceiling else f"{'-':>6}"
        accept = f"{r['acceptance']:7.2f}" if r["acceptance"] is not None else f"{'-':>7}"
        print(f"{r['batch']:5d} {r['mode']:>12} {r['k']:2d} {r['decode_tok_s']:9.1f} "
              f"{r['decode_tok_s'] / off[r['batch']]:6.2f}x {accept} "
              f"{ceiling or 0:9.1f} {share}")
    full = argparse.Namespace(**{**QWEN36_35B_A3B,
                                 "layer_types": ["linear_attention"] * 3 * 10
                                 + ["full_attention"] * 10})
    for batch in sorted(off) if rate == 1.0 else ():
        base = step_bytes(full, batch, 0, args.prompt)
        ratios = []
        for k in sorted({r["k"] for r in rows if r["k"]}):
            moved, emitted = step_bytes(full, batch, k, args.prompt)
            ratios.append(f"K={k} {emitted / moved * base[0] / base[1]:.2f}x")
        print(f"40 layers, batch {batch}: the speed of light over plain decoding's ceiling "
              f"(bytes per emitted token): {', '.join(ratios)}")
    print("goal (issue 34): agree K=2 >= 1.8x off at batch 1; random never slower than off")


MODES = ("agree", "random", "auto", "agree-eager", "random-eager")


def numbers(text: str, kind, flag: str) -> list:
    """A comma-separated list of `kind` values, or exit naming the flag."""
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated {kind.__name__} values, got {text!r}") from None
    return values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--k", default="1,2,3", help="draft tokens per step, comma-separated")
    p.add_argument("--moe-cache-rate", default="1",
                   help="expert cache rates, comma-separated (below 1: experts offloaded)")
    p.add_argument("--routing", choices=("uniform", "skewed", "model"), default="model")
    p.add_argument("--modes", default="agree,random,auto",
                   help=f"rows beside off, comma-separated: {','.join(MODES)}")
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args()
    args.modes = args.modes.split(",")
    if not args.modes or any(m not in MODES for m in args.modes):
        raise SystemExit(f"--modes: comma-separated values among {','.join(MODES)}")
    if args.layers % 4:
        raise SystemExit("--layers must be a multiple of 4 (three GDN layers per full one)")
    rates = numbers(args.moe_cache_rate, float, "--moe-cache-rate")
    if any(not 0.0 < r <= 1.0 for r in rates):
        raise SystemExit("--moe-cache-rate: rates in (0, 1]")
    sizes = numbers(args.batch_sizes, int, "--batch-sizes")
    if any(b < 1 for b in sizes):
        raise SystemExit("--batch-sizes: batch sizes of at least 1")
    ks = numbers(args.k, int, "--k")
    if any(not 1 <= k <= 4 for k in ks):
        raise SystemExit("--k values must be in 1..4")
    bandwidth = d2d_bandwidth()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp), args.layers)
        cfg = model.config
        del model
        torch.cuda.empty_cache()
        add_mtp_block(Path(tmp), cfg)
        rows = []
        for rate in rates:
            rows += run(tmp, args, rate, sizes, ks, bandwidth)
            gc.collect()
            torch.cuda.empty_cache()
    for rate in rates:
        report([r for r in rows if r["rate"] == rate], args, rate, bandwidth)
    if args.results:
        args.results.write_text(json.dumps({"bandwidth_Bps": bandwidth, "rows": rows,
                                            "args": {k: str(v) for k, v in vars(args).items()}},
                                           indent=1))


if __name__ == "__main__":
    main()
