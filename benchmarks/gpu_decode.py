"""FreeToken vs HF transformers on one GPU, with the bandwidth ceiling measured in the same run.

    python benchmarks/gpu_decode.py [--models smollm2,qwen3-8b] [--compile] [--gen 128]

For each random-weight model of a real config: FreeToken through the engine (`ft bench`'s code,
CUDA graphs), transformers' default generate, optionally its static cache + torch.compile, and
the ceiling = measured D2D bandwidth / bytes read per decode step at batch 1.
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

CONFIGS = {
    "smollm2": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    # Qwen3-8B's shapes at 8 of its 36 layers (keeps the run short; still bandwidth-bound).
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=8,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6)),
}


def replay_ms(graph, reps: int) -> float:
    """Median GPU milliseconds of one replay of a captured CUDA graph, between CUDA events."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def d2d_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 20)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / sorted(times[3:])[10]


def build(name: str, directory: Path):
    import transformers

    from tests.models.helpers import write_byte_bpe

    config_cls, model_cls, settings = CONFIGS[name]
    write_byte_bpe(directory)
    config = getattr(transformers, config_cls)(**settings, eos_token_id=2, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    return model


def bytes_per_step(model, context: int) -> int:
    """Weights read once per decode step (embedding rows aside) plus the KV of the context."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        weights += model.get_input_embeddings().weight.numel() * 2
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * context
    return weights + kv


def hf_decode(model, prompt_len: int, gen: int, batch: int = 1, static: bool = False) -> float:
    """Decode tok/s of transformers' generate. Static cache: every call has the same lengths
    (another length would recompile), so the rate is gen / time of a whole warmed-up call,
    its one prefill forward included."""
    ids = torch.randint(10, 200, (batch, prompt_len), device="cuda")
    kwargs = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False)
    if static:
        kwargs["cache_implementation"] = "static"
        for _ in range(2):                       # the first call compiles
            model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
        assert out.shape[1] == prompt_len + gen
        return batch * gen / (time.perf_counter() - t)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    torch.cuda.synchronize()
    t = time.perf_counter()
    short = model.generate(ids, **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(ids, **kwargs)
    torch.cuda.synchronize()
    assert out.shape[1] == prompt_len + gen and short.shape[1] == prompt_len + 2
    return batch * (gen - 2) / (time.perf_counter() - t - prefill)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="smollm2,qwen3-8b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--compile", action="store_true", help="also transformers static+compile")
    p.add_argument("--compile-gen", type=int, default=64, help="tokens per compiled generate")
    args = p.parse_args()
    from freetoken.cli.bench import run_bench

    bandwidth = d2d_bandwidth()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = {"bandwidth_Bps": bandwidth}
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            model = build(name, Path(tmp))
            sizes = [int(b) for b in args.batch_sizes.split(",")]
            ours = run_bench(tmp, "cuda", args.prompt, 2048, args.gen, sizes)
            hf = hf_decode(model, args.prompt, min(args.gen, 64))
            print(f"[{name}] FreeToken: {json.dumps(ours)}\n[{name}] transformers default "
                  f"generate: {hf:.1f} tok/s", flush=True)
            hf_compiled = None
            if args.compile and name == "smollm2":
                # A static cache makes generate compile the forward itself (torch.compile).
                t = time.perf_counter()
                try:
                    hf_compiled = hf_decode(model, args.prompt, args.compile_gen, static=True)
                except Exception as exc:  # report the peer's failure, keep measuring
                    print(f"  transformers static cache + compile failed: {exc!s:.300}")
                print(f"  (transformers compile + runs took {time.perf_counter() - t:.0f} s)")
            ceiling = bandwidth / bytes_per_step(model, args.prompt + args.gen // 2)
            del model
            torch.cuda.empty_cache()
        b1 = ours["batches"][0]["decode_tok_s"]
        results[name] = {"freetoken": ours, "hf_default_tok_s": hf,
                         "hf_static_compile_tok_s": hf_compiled, "ceiling_tok_s": ceiling}
        print(f"\n== {name} ==")
        print(f"FreeToken prefill {ours['prefill_tok_s']:.0f} tok/s, TTFT {ours['ttft_s'] * 1e3:.1f} ms,"
              f" ready {ours['start_to_ready_s']:.1f} s")
        for row in ours["batches"]:
            print(f"  batch {row['batch']:>3}: {row['decode_tok_s']:9.1f} tok/s")
        print(f"transformers default generate, batch 1: {hf:.1f} tok/s -> FreeToken {b1 / hf:.1f}x")
        if hf_compiled:
            print(f"transformers static+compile, batch 1: {hf_compiled:.1f} tok/s -> "
                  f"FreeToken {b1 / hf_compiled:.2f}x")
        print(f"ceiling at batch 1: {ceiling:.0f} tok/s -> FreeToken at {100 * b1 / ceiling:.0f}%")
        big = [r for r in ours["batches"] if r["batch"] == 32]
        if big:
            print(f"batch 32 aggregate / batch 1: {big[0]['decode_tok_s'] / b1:.1f}x")
    print(json.dumps(results, default=str)[:4000])


if __name__ == "__main__":
    main()
