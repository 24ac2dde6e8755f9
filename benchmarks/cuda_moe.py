"""The CUDA MoE kernels at a Qwen3-30B-A3B layer's shape: correctness, then GPU time per call.

    python benchmarks/cuda_moe.py [--tokens 1 8 32 2048] [--dtype bfloat16]

First checks moe_topk_softmax and moe_experts against a float64 torch reference at every batch
size (relative RMS error, and the max error over the reference's RMS). Then times each kernel
by replaying a CUDA graph of N calls (no host launch cost) and prints, per batch size: routing
and experts time, the expert weight bytes touched (distinct experts x 3*H*I*itemsize) over the
experts time as GB/s beside a device-to-device copy's bandwidth measured in the same run, and
TFLOP/s (2 * T * K * 3 * H * I flops). Beside it, for scale, the per-expert torch loop that
eager HF transformers runs (F.linear per expert hit, host-synchronous), timed eagerly.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from freetoken.kernel import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cuda_kernels import graph_time_us  # noqa: E402
from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402


def reference(x, w13, w2, ids, weights):
    """float64 out[T, H] by the contract's formula (a loop over the experts in use)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for s in ids.unique().tolist():
        t_idx, k_idx = (ids == s).nonzero(as_tuple=True)
        xs = x[t_idx].double()
        h = F.silu(xs @ w13[s, :inter].double().T) * (xs @ w13[s, inter:].double().T)
        out.index_add_(0, t_idx, weights[t_idx, k_idx].double()[:, None] * (h @ w2[s].double().T))
    return out


def torch_loop(x, w13, w2, ids, weights):
    """The per-expert loop of eager HF MoE blocks, in the model dtype (host syncs included)."""
    out = torch.zeros_like(x)
    for s in ids.unique().tolist():
        t_idx, k_idx = (ids == s).nonzero(as_tuple=True)
        gate, up = F.linear(x[t_idx], w13[s]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[s]) * weights[t_idx, k_idx, None].to(x.dtype)
        out.index_add_(0, t_idx, y)
    return out


def eager_time_us(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def bench(T, E, K, H, inter, dtype, w13, w2, copy_gbs) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    weights = torch.empty(T, K, device="cuda")
    ids = torch.empty(T, K, dtype=torch.int32, device="cuda")
    emap = torch.arange(E, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    ws = torch.empty(ops.moe_workspace_bytes(T, K, E, inter, dtype), dtype=torch.uint8,
                     device="cuda")
    route = lambda: ops.moe_topk_softmax(weights, ids, logits, True)  # noqa: E731
    experts = lambda: ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws)  # noqa: E731
    route()
    p = torch.softmax(logits.double(), -1)
    top = p.topk(K, dim=-1).values
    route_err = (weights.double() - top / top.sum(-1, keepdim=True)).abs().max().item()
    experts()
    ref = reference(x, w13, w2, ids.long(), weights)
    rms = ref.square().mean().sqrt().item()
    err = out.double() - ref
    row = dict(T=T, route_err=route_err, rel_rms=err.square().mean().sqrt().item() / rms,
               max_over_rms=err.abs().max().item() / rms)
    row["route_us"] = graph_time_us(route)
    row["experts_us"] = graph_time_us(experts)
    distinct = ids.unique().numel()
    touched = distinct * 3 * H * inter * w13.element_size()
    row["gbs"] = touched / row["experts_us"] / 1e3
    row["pct_copy"] = 100 * row["gbs"] / copy_gbs
    row["tflops"] = 2 * T * K * 3 * H * inter / row["experts_us"] / 1e6
    row["experts_hit"] = distinct
    long_ids = ids.long()
    row["torch_us"] = eager_time_us(lambda: torch_loop(x, w13, w2, long_ids, weights))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 2048])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    E, K, H, inter = args.experts, args.top_k, args.hidden, args.intermediate
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(E, 2 * inter, H, device="cuda", generator=gen) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, inter, device="cuda", generator=gen) / math.sqrt(inter)).to(dtype)
    copy_gbs = d2d_bandwidth() / 1e9  # the same measure as the other GPU benchmarks
    print(f"{torch.cuda.get_device_name()}  E={E} K={K} H={H} I={inter} {args.dtype}  "
          f"D2D copy {copy_gbs:,.0f} GB/s")
    head = (f"{'T':>5} {'route us':>9} {'experts us':>11} {'experts':>8} {'GB/s':>7} "
            f"{'% copy':>7} {'TFLOP/s':>8} {'torch loop us':>14} {'rel RMS err':>12} {'max/RMS':>8} "
            f"{'route err':>10}")
    print(head)
    print("-" * len(head))
    for T in args.tokens:
        r = bench(T, E, K, H, inter, dtype, w13, w2, copy_gbs)
        print(f"{T:>5} {r['route_us']:>9.2f} {r['experts_us']:>11.2f} {r['experts_hit']:>8} "
              f"{r['gbs']:>7.0f} {r['pct_copy']:>6.1f}% {r['tflops']:>8.1f} "
              f"{r['torch_us']:>14.1f} "
              f"{r['rel_rms']:>12.2e} {r['max_over_rms']:>8.2e} {r['route_err']:>10.1e}")


if __name__ == "__main__":
    main()
