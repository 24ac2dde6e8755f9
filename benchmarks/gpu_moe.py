"""FreeToken vs HF transformers on a Qwen3-30B-A3B-shaped MoE, with the batch-1 bandwidth
ceiling measured in the same run.

    python benchmarks/gpu_moe.py [--layers 48] [--gen 128] [--batch-sizes 1,8,32] [--no-compile]

Random bf16 weights of the real config (hidden 2048, 128 experts, 8 per token, expert width
768, 32 q / 4 kv heads of 128) saved as an HF folder; `--layers` cuts the depth (the full 48
layers need ~61 GB on disk and twice that in GPU memory while both engines hold the weights).
Measured: FreeToken decode tok/s at each batch size and prefill tok/s at 2048 tokens through
the engine (CUDA graphs); transformers' default generate (eager) and its fastest mode (static
cache + torch.compile) at batch 1, its eager decode at the largest batch and its 2048-token
prefill; the ceiling = D2D copy bandwidth / bytes one batch-1 decode step reads (attention,
router, the 8 routed experts, norms, one embedding row, the LM head and the KV of the context),
and at batch B, B x bandwidth / the bytes of a B-sequence step, whose layers read the expected
number of distinct experts B tokens route to (uniform routing; 112 of 128 at B = 32).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth, hf_decode  # noqa: E402

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, max_position_embeddings=40960,
    tie_word_embeddings=False, rms_norm_eps=1e-6, decoder_sparse_step=1, mlp_only_layers=[])


def checkpoint_bytes(layers: int) -> int:
    """bf16 bytes of the saved folder (every expert, embedding and LM head)."""
    c = QWEN3_30B_A3B
    h, q, kv = c["hidden_size"], c["num_attention_heads"] * 128, c["num_key_value_heads"] * 128
    per_layer = h * (2 * q + 2 * kv) + c["num_experts"] * (h + 3 * h * c["moe_intermediate_size"])
    return 2 * (layers * per_layer + 2 * c["vocab_size"] * h)


def build(directory: Path, layers: int):
    """Random bf16 Qwen3-MoE on the GPU, saved (with a tokenizer) to `directory`."""
    import shutil

    import transformers

    need, free = checkpoint_bytes(layers), shutil.disk_usage(directory).free
    if need > 0.95 * free:
        raise SystemExit(f"{layers} layers need {need / 1e9:.0f} GB in {directory}, "
                         f"{free / 1e9:.0f} GB free: pass --layers N (e.g. 12) or set TMPDIR")

    from tests.models.helpers import write_byte_bpe

    write_byte_bpe(directory)
    config = transformers.Qwen3MoeConfig(**QWEN3_30B_A3B, num_hidden_layers=layers,
                                         eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    return model


def experts_touched(cfg, batch: int) -> float:
    """Expected distinct experts a layer reads for `batch` tokens routed independently and
    uniformly (top-k distinct per token): E * (1 - (1 - k/E)^batch); k at batch 1."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def step_bytes(cfg, context: int, batch: int = 1, item: int = 2) -> float:
    """Bytes one decode step of `batch` sequences reads: the weights (each touched expert once)
    plus the KV of `context` positions per sequence."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h + 2 * h + 2 * cfg.head_dim
    router = cfg.num_experts * h
    experts = experts_touched(cfg, batch) * 3 * h * cfg.moe_intermediate_size
    per_layer = (attention + router + experts) * item
    head = (cfg.vocab_size * h + h + batch * h) * item  # LM head, final norm, embedding rows
    kv_cache = 2 * kv * item * context * batch
    return cfg.num_hidden_layers * (per_layer + kv_cache) + head


def bytes_per_token(cfg, context: int, item: int = 2) -> int:
    """Weights one batch-1 decode step reads, plus the KV of `context` positions."""
    return round(step_bytes(cfg, context, 1, item))


def hf_prefill(model, tokens: int) -> float:
    ids = torch.randint(10, 200, (1, tokens), device="cuda")
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t)


def measure_transformers(model, args) -> dict:
    out = {"eager_bs1_tok_s": hf_decode(model, args.prompt, min(args.gen, 32)),
           "prefill_2048_tok_s": hf_prefill(model, 2048)}
    big = max(int(b) for b in args.batch_sizes.split(","))
    out[f"eager_bs{big}_tok_s"] = hf_decode(model, args.prompt, 16, batch=big)
    if args.compile:
        t = time.perf_counter()
        try:   # static cache: generate compiles the forward (grouped_mm experts)
            out["static_compile_bs1_tok_s"] = hf_decode(model, args.prompt, args.compile_gen,
                                                        static=True)
        except Exception as exc:  # report the peer's failure, keep measuring
            out["static_compile_error"] = f"{exc!s:.300}"
        out["compile_and_runs_s"] = time.perf_counter() - t
    return out


def report(ours: dict, hf: dict, ceilings: dict, layers: int) -> None:
    """`ceilings`: batch size -> tok/s at the bandwidth ceiling (batch * bandwidth / step bytes)."""
    b1, ceiling = ours["batches"][0]["decode_tok_s"], ceilings[1]
    print(f"\n== Qwen3-30B-A3B shape, {layers} layers, bf16 ==")
    print(f"{'':34}{'FreeToken':>12}{'transformers':>14}")
    print(f"{'prefill 2048 tokens (tok/s)':34}{ours['prefill_tok_s']:12.0f}"
          f"{hf['prefill_2048_tok_s']:14.0f}")
    for row in ours["batches"]:
        peer = hf.get(f"eager_bs{row['batch']}_tok_s")
        peer_text = f"{peer:14.1f}" if peer else f"{'-':>14}"
        share = 100 * row["decode_tok_s"] / ceilings[row["batch"]]
        print(f"{'decode batch %d (tok/s)' % row['batch']:34}{row['decode_tok_s']:12.1f}"
              f"{peer_text}   {share:.0f}% of its ceiling {ceilings[row['batch']]:.0f}")
    if hf.get("static_compile_bs1_tok_s"):
        print(f"{'transformers static+compile bs1':34}{'':12}"
              f"{hf['static_compile_bs1_tok_s']:14.1f}")
    print(f"batch-1 ceiling {ceiling:.0f} tok/s: FreeToken at {100 * b1 / ceiling:.0f}%")
    big = [r for r in ours["batches"] if r["batch"] == 32]
    if big:
        # uniform routing reads ~112 of 128 experts a layer at batch 32: the ceiling itself
        # grows far less than 32x from batch 1
        print(f"batch 32 / batch 1: {big[0]['decode_tok_s'] / b1:.1f}x "
              f"(at the two ceilings: {ceilings[32] / ceilings[1]:.1f}x)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip transformers' static cache + torch.compile (minutes to compile)")
    p.add_argument("--compile-gen", type=int, default=32)
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="write the random-weight HF folder here and keep it (for llama.cpp's "
                        "converter in the same run)")
    args = p.parse_args()
    from freetoken.cli.bench import run_bench

    bandwidth = d2d_bandwidth()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        model = build(Path(tmp), args.layers)
        cfg = model.config
        hf = measure_transformers(model, args)
        print(f"transformers: {json.dumps(hf)}", flush=True)
        del model
        torch.cuda.empty_cache()
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        ours = run_bench(tmp, "cuda", args.prompt, 2048, args.gen, sizes)
    context = args.prompt + args.gen // 2
    ceilings = {b: b * bandwidth / step_bytes(cfg, context, b) for b in [1, *sizes]}
    ceiling = ceilings[1]
    report(ours, hf, ceilings, args.layers)
    print(json.dumps({"bandwidth_Bps": bandwidth, "layers": args.layers, "ceiling_tok_s": ceiling,
                      "ceilings_tok_s": ceilings,
                      "freetoken": ours, "transformers": hf}, default=str))


if __name__ == "__main__":
    main()
