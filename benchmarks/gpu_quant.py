"""GGUF blocks on the GPU against bf16: an 8B-shaped model, decode at batch 1 beside each
format's own bandwidth ceiling measured in the same run, and prefill.

    python benchmarks/gpu_quant.py [--layers 8] [--formats bf16,q4_k,q4_k-v3] [--kernels-only]

Qwen3-8B's shapes at `--layers` of its 36 layers, random weights, written as GGUF files: BF16
tensors, and Q4_K blocks for every matrix (embedding and head too). gguf's numpy quantizer has
no K-quants, so the Q4_K blocks are random bytes with finite f16 scales (tests/kernel/
gguf_random.py): the same bytes move and decode as with a real file. Both files go through the
engine (`ft bench`'s code, CUDA graphs); `q4_k-v3` runs the Q4_K file again with
FREETOKEN_QUANT_GEMV=v3 (gguf_gemv_q8 on the fused decode chain). Ceiling = D2D copy bandwidth (read + write, as
benchmarks/gpu_decode.py) / bytes one decode step reads (every tensor but the embedding, which
is gathered by row, plus the bf16 KV of the context). A kernel table first: the GEMV at batch
1 (gguf_matmul, and for Q4_K gguf_gemv and gguf_gemv_q8 too) and the GEMM at 2048 rows on an
[12288, 4096] matrix of every GGUF type, against torch bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402  (one way to measure the ceiling)

QWEN3_8B = dict(vocab=151936, hidden=4096, inter=12288, heads=32, kv_heads=8, head_dim=128,
                theta=1000000.0, eps=1e-6, context=40960)
BF16, Q4_K = 30, 12



def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of `fn`, from a CUDA graph of `reps` calls (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return sorted(times)[3]


def kernel_table(bandwidth: float) -> list[dict]:
    """GEMV (M=1) read bandwidth and GEMM (M=2048) TFLOP/s for [12288, 4096] weights."""
    from freetoken.kernel import ops
    from tests.kernel.gguf_random import BLOCKS, NAMES, random_blocks

    n, k, rng, rows = 12288, 4096, np.random.default_rng(0), []
    x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    cases = [("bf16 (torch)", w16.nbytes, lambda o, x: torch.mm(x, w16.T, out=o))]
    for qtype in sorted(BLOCKS):
        blocks = torch.from_numpy(random_blocks(qtype, n, k, rng)).cuda()
        cases.append((NAMES[qtype], blocks.nbytes,
                      lambda o, x, b=blocks, t=qtype: ops.gguf_matmul(o, x, b, t)))
        if qtype == Q4_K:   # the decode GEMVs (one row of x only)
            cases.append(("Q4_K v2 gemv", blocks.nbytes,
                          lambda o, x, b=blocks: ops.gguf_gemv(o, x, b, Q4_K, 0)))
            cases.append(("Q4_K v3 q8", blocks.nbytes,
                          lambda o, x, b=blocks: ops.gguf_gemv_q8(o, x, b, Q4_K)))
    for name, nbytes, fn in cases:
        o1 = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ob = torch.empty(2048, n, device="cuda", dtype=torch.bfloat16)
        t1 = graph_time(lambda: fn(o1, x1))
        gemm = " v" not in name
        tb = graph_time(lambda: fn(ob, xb), reps=5) if gemm else float("nan")
        rows.append({"weight": name, "bytes": nbytes, "gemv_us": t1 * 1e6,
                     "gemv_GBps": nbytes / t1 / 1e9,
                     "gemv_pct_of_read_bw": 100 * nbytes / t1 / (bandwidth / 2),
                     "gemm_TFLOPs": 2 * 2048 * n * k / tb / 1e12})
    return rows


def _tokenizer(writer, directory: Path, vocab: int) -> None:
    """The tests' byte-level BPE, padded with control tokens to the model's vocabulary."""
    from tests.models.helpers import write_byte_bpe

    write_byte_bpe(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    tokens = [None] * len(spec["model"]["vocab"])
    for token, index in spec["model"]["vocab"].items():
        tokens[index] = token
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    types = [3 if t in specials else 1 for t in tokens]
    pad = vocab - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens + [f"<|pad_{i}|>" for i in range(pad)])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m)
                             for m in spec["model"]["merges"]])
    writer.add_token_types(types + [3] * pad)
    writer.add_eos_token_id(spec["model"]["vocab"]["<|im_end|>"])
    writer.add_add_bos_token(False)


def _matrix(rows: int, cols: int, qtype: int, rng) -> np.ndarray:
    from tests.kernel.gguf_random import random_blocks

    if qtype == Q4_K:
        return random_blocks(Q4_K, rows, cols, rng)
    w = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 0.02
    return w.view(torch.int16).cpu().numpy().view(np.uint8)        # BF16 as raw bytes


def write_model(path: Path, layers: int, qtype: int) -> int:
    """Writes the GGUF; returns the bytes one decode step reads (embedding excluded)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    c, rng = QWEN3_8B, np.random.default_rng(1)
    writer = GGUFWriter(str(path), "qwen3")
    writer.add_block_count(layers)
    writer.add_context_length(c["context"])
    writer.add_embedding_length(c["hidden"])
    writer.add_feed_forward_length(c["inter"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_rope_freq_base(c["theta"])
    writer.add_layer_norm_rms_eps(c["eps"])
    _tokenizer(writer, path.parent, c["vocab"])
    h, q, kv, inter = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["inter"]
    mats = {"token_embd.weight": (c["vocab"], h), "output.weight": (c["vocab"], h)}
    norms = {"output_norm.weight": h}
    for i in range(layers):
        p = f"blk.{i}."
        mats.update({p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h),
                     p + "attn_v.weight": (kv, h), p + "attn_output.weight": (h, q),
                     p + "ffn_gate.weight": (inter, h), p + "ffn_up.weight": (inter, h),
                     p + "ffn_down.weight": (h, inter)})
        norms.update({p + "attn_norm.weight": h, p + "ffn_norm.weight": h,
                      p + "attn_q_norm.weight": c["head_dim"], p + "attn_k_norm.weight": c["head_dim"]})
    read = 0
    for name, (rows, cols) in mats.items():
        data = _matrix(rows, cols, qtype, rng)
        read += 0 if name == "token_embd.weight" else data.nbytes
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType(qtype))
    for name, size in norms.items():
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))
        read += 4 * size
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--formats", default="bf16,q4_k,q4_k-v3")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--kernels-only", action="store_true")
    args = p.parse_args()
    from freetoken.cli.bench import run_bench

    gemv_default = os.environ.get("FREETOKEN_QUANT_GEMV", "v2")

    t_start = time.perf_counter()
    bandwidth = d2d_bandwidth()
    print(f"D2D copy bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    kernels = kernel_table(bandwidth)
    print("\nkernel, [12288, 4096] weight | GEMV M=1: us, GB/s, % of read bw (copy/2) | "
          "GEMM M=2048: TFLOP/s")
    for r in kernels:
        print(f"  {r['weight']:<13} {r['gemv_us']:8.1f} us {r['gemv_GBps']:7.0f} GB/s "
              f"{r['gemv_pct_of_read_bw']:5.0f}%   {r['gemm_TFLOPs']:7.1f}", flush=True)
    results = {"bandwidth_Bps": bandwidth, "kernels": kernels, "models": {}}
    kv_per_token = 2 * args.layers * QWEN3_8B["kv_heads"] * QWEN3_8B["head_dim"] * 2
    formats = {"bf16": BF16, "q4_k": Q4_K, "q4_k-v3": Q4_K}
    unknown = set(args.formats.split(",")) - set(formats)
    if unknown:
        p.error(f"--formats: unknown {', '.join(sorted(unknown))}; known: {', '.join(formats)}")
    for fmt in ([] if args.kernels_only else args.formats.split(",")):
        qtype = formats[fmt]
        os.environ["FREETOKEN_QUANT_GEMV"] = "v3" if fmt.endswith("-v3") else gemv_default
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"qwen3-8b-{args.layers}l-{fmt}.gguf"
            t = time.perf_counter()
            read = write_model(path, args.layers, qtype)
            print(f"[{fmt}] wrote {path.stat().st_size / 1e9:.2f} GB in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
            ours = run_bench(str(path), "cuda", args.prompt, args.prefill, args.gen, [1])
        step_bytes = read + kv_per_token * (args.prompt + args.gen // 2)
        ceiling = bandwidth / step_bytes
        decode = ours["batches"][0]["decode_tok_s"]
        results["models"][fmt] = {"bytes_per_step": step_bytes, "ceiling_tok_s": ceiling,
                                  "decode_tok_s": decode, "prefill_tok_s": ours["prefill_tok_s"],
                                  "bench": ours}
        print(f"[{fmt}] decode {decode:.1f} tok/s, ceiling {ceiling:.0f}, prefill "
              f"{ours['prefill_tok_s']:.0f} tok/s", flush=True)
        torch.cuda.empty_cache()
    if results["models"]:
        print(f"\nQwen3-8B shapes, {args.layers} layers, batch 1, context {args.prompt}+{args.gen}")
        print(f"{'format':<8} {'GB/step':>8} {'ceiling':>9} {'decode':>9} {'% ceil':>7} "
              f"{'prefill ' + str(args.prefill):>14}")
        for fmt, r in results["models"].items():
            print(f"{fmt:<8} {r['bytes_per_step'] / 1e9:8.3f} {r['ceiling_tok_s']:9.0f} "
                  f"{r['decode_tok_s']:9.1f} {100 * r['decode_tok_s'] / r['ceiling_tok_s']:6.1f}% "
                  f"{r['prefill_tok_s']:14.0f}")
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    print(json.dumps(results, default=str)[:6000])


if __name__ == "__main__":
    main()
