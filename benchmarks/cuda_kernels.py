"""Side-by-side timings of the CUDA kernels against torch equivalents (GPU time, graph replay).

    python benchmarks/cuda_kernels.py [--dram-gbs 4300]

Each op is captured N times in one CUDA graph and replayed, so the numbers are GPU time per
call without host launch overhead. Reports achieved bandwidth against the GPU's copy bandwidth.
"""

from __future__ import annotations

import argparse
import inspect
import math

import torch
import torch.nn.functional as F

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function


def graph_time_us(fn, calls: int = 20, reps: int = 7) -> float:
    """Median GPU microseconds per call of `fn`, measured by replaying a captured graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (module load, allocator)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def paged_attention_call(out, q, kc, vc, tables, seq_lens, qsl, bs, scale, ws):
    if "workspace" in inspect.signature(ops.paged_attention).parameters:
        return lambda: ops.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, bs, scale, 0,
                                           workspace=ws)
    fn = get_function("attention", "paged_attention", q.device)
    return lambda: fn(out, q, kc, vc, tables, seq_lens, qsl, bs, scale, 0, ws)


def bench_decode(batch: int, context: int, dram: float, hq=32, hk=8, d=128, bs=16) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    blocks = math.ceil(context / bs)
    kc = torch.randn(batch * blocks * bs, hk, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
    out, ws = torch.empty_like(q), torch.empty(1 << 20, device=dev)
    ours = graph_time_us(paged_attention_call(out, q, kc, vc, tables, seq_lens, qsl, bs,
                                              d ** -0.5, ws))
    # torch: SDPA over K/V already gathered into [B, Hk, ctx, D] (the gather is not timed).
    slots = (tables.long()[:, :, None] * bs + torch.arange(bs, device=dev)).view(batch, -1)
    k = kc[slots[:, :context]].transpose(1, 2).contiguous()
    v = vc[slots[:, :context]].transpose(1, 2).contiguous()
    qt = q[:, :, None, :]
    theirs = graph_time_us(lambda: F.scaled_dot_product_attention(qt, k, v, enable_gqa=True))
    kv_bytes = 2 * batch * context * hk * d * 2
    print(f"decode  B={batch:<3} ctx={context:<5} ours {ours:8.1f} us {kv_bytes / ours / 1e3:7.0f} "
          f"GB/s ({kv_bytes / ours / 1e3 / dram:5.1%})   sdpa {theirs:8.1f} us "
          f"{kv_bytes / theirs / 1e3:7.0f} GB/s")


def bench_prefill(tokens: int, hq=32, hk=8, d=128, bs=16) -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    blocks = math.ceil(tokens / bs)
    kc = torch.randn(blocks * bs, hk, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.arange(blocks, device=dev, dtype=torch.int32)[None]
    seq_lens = torch.tensor([tokens], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, tokens], device=dev, dtype=torch.int32)
    q = torch.randn(tokens, hq, d, device=dev, dtype=dtype)
    out = torch.empty_like(q)
    ours = graph_time_us(paged_attention_call(out, q, kc, vc, tables, seq_lens, qsl, bs,
                                              d ** -0.5, None), calls=5)
    # torch: SDPA (flash) with K/V expanded to every query head.
    qt = q.transpose(0, 1)[None]
    k = kc[:tokens].repeat_interleave(hq // hk, 1).transpose(0, 1)[None]
    v = vc[:tokens].repeat_interleave(hq // hk, 1).transpose(0, 1)[None]
    theirs = graph_time_us(lambda: F.scaled_dot_product_attention(qt, k, v, is_causal=True),
                           calls=5)
    flops = 4 * hq * d * tokens * tokens / 2  # causal: half the square, QK and PV
    print(f"prefill T={tokens:<5} ours {ours:8.1f} us {flops / ours / 1e6:6.1f} TFLOP/s   "
          f"sdpa {theirs:8.1f} us {flops / theirs / 1e6:6.1f} TFLOP/s")


def bench_rms_norm(rows: int, width: int, dram: float) -> None:
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(width, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    ours = graph_time_us(lambda: ops.rms_norm(out, x, w, 1e-5))
    theirs = graph_time_us(lambda: F.rms_norm(x, (width,), w, 1e-5))
    moved = 2 * x.numel() * 2
    print(f"rms_norm {rows:>5}x{width:<5} ours {ours:7.1f} us {moved / ours / 1e3:6.0f} GB/s "
          f"({moved / ours / 1e3 / dram:5.1%})   torch {theirs:7.1f} us "
          f"{moved / theirs / 1e3:6.0f} GB/s")


def bench_sampling(rows: int, vocab: int) -> None:
    logits = torch.randn(rows, vocab, device="cuda") * 4
    out = torch.empty(rows, dtype=torch.int64, device="cuda")
    temp = torch.full((rows,), 0.7, device="cuda")
    top_k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.9, device="cuda")
    fn = getattr(ops, "sample_tokens", None) or get_function("sampling", "sample_tokens",
                                                             logits.device)
    ours = graph_time_us(lambda: fn(out, logits, temp, top_k, top_p, 1, 0))

    def torch_sample():
        probs = torch.softmax(logits / 0.7, -1)
        vals, idx = probs.topk(50, -1)
        keep = vals.cumsum(-1) - vals < 0.9
        vals = torch.where(keep, vals, 0.0)
        return idx.gather(-1, torch.multinomial(vals, 1))

    theirs = graph_time_us(torch_sample)
    print(f"sample  B={rows:<3} V={vocab}  top-k 50 + top-p 0.9: ours {ours:7.1f} us   "
          f"torch (topk+multinomial) {theirs:7.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dram-gbs", type=float, default=4300.0,
                        help="the GPU's measured copy bandwidth, GB/s (H200: ~4300)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "| bf16, Hq=32 Hk=8 D=128, block 16")
    for context in (512, 2048):
        for batch in (1, 8, 32, 64):
            bench_decode(batch, context, args.dram_gbs)
    for tokens in (512, 2048, 8192):
        bench_prefill(tokens)
    for rows, width in ((1, 4096), (64, 4096), (4096, 4096), (16384, 8192)):
        bench_rms_norm(rows, width, args.dram_gbs)
    for rows in (1, 64):
        bench_sampling(rows, 151936)


if __name__ == "__main__":
    main()
