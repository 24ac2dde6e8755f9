"""The GGUF experts kernel (moe_experts_gguf) at a Qwen3-30B-A3B layer's shape, beside the bf16
experts kernel (moe_experts) on the same experts dequantized: correctness, then GPU time.

    python benchmarks/cuda_moe_gguf.py [--tokens 1 8 32 2048] [--types Q4_K/Q6_K Q8_0/Q8_0]

Experts are random valid blocks (tests/kernel/gguf_random.py) of the gate/up type and the down
type of each pair. Per batch size: the relative RMS error of both kernels against a float64
reference on the dequantized weights, GPU time per call of each (a replayed CUDA graph of N
calls), the expert bytes touched (distinct experts x their quantized bytes, or x 3*H*I*2 for
bf16) over that time as GB/s and as a share of a device-to-device copy's bandwidth measured in
the same run. At batch 1 the share is the decode figure to watch: both kernels read only the
experts a token routes to, the GGUF one 3.1x fewer bytes at Q4_K/Q6_K.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from freetoken.kernel import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cuda_kernels import graph_time_us  # noqa: E402
from benchmarks.cuda_moe import reference  # noqa: E402
from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402
from tests.kernel.gguf_random import NAMES, dequantize, random_blocks  # noqa: E402

TYPE_IDS = {name: qtype for qtype, name in NAMES.items()}


def experts(qtype: int, E: int, rows: int, cols: int, rng) -> tuple:
    """(uint8 blocks [E, rows, row_bytes], bf16 values [E, rows, cols]) on the GPU."""
    blocks = random_blocks(qtype, E * rows, cols, rng)
    values = torch.from_numpy(dequantize(blocks, qtype).reshape(E, rows, cols))
    return (torch.from_numpy(blocks.reshape(E, rows, -1)).cuda(),
            values.to(torch.bfloat16).cuda())


def bench(T, E, K, H, inter, q13, q2, w13, w2, copy_gbs) -> dict:
    (b13, f13), (b2, f2) = w13, w2
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    weights = torch.empty(T, K, device="cuda")
    ids = torch.empty(T, K, dtype=torch.int32, device="cuda")
    emap = torch.arange(E, dtype=torch.int32, device="cuda")
    out_q, out_b = torch.empty_like(x), torch.empty_like(x)
    ws = torch.empty(ops.moe_workspace_bytes(T, K, E, inter, 2), dtype=torch.uint8,
                     device="cuda")
    ops.moe_topk_softmax(weights, ids, logits, True)
    quant = lambda: ops.moe_experts_gguf(out_q, x, b13, b2, q13, q2, ids, weights,  # noqa: E731
                                         emap, ws)
    bf16 = lambda: ops.moe_experts(out_b, x, f13, f2, ids, weights, emap, ws)  # noqa: E731
    quant()
    bf16()
    # the reference on the exact dequantized values (f13/f2 hold them rounded to bf16)
    ref = reference(x, exact_values(b13, q13, f13), exact_values(b2, q2, f2), ids.long(),
                    weights)
    rms = ref.square().mean().sqrt().item()
    row = {"T": T, "experts_hit": ids.unique().numel()}
    row["err_q"] = (out_q.double() - ref).square().mean().sqrt().item() / rms
    row["err_b"] = (out_b.double() - ref).square().mean().sqrt().item() / rms
    row["us_q"], row["us_b"] = graph_time_us(quant), graph_time_us(bf16)
    per_expert_q = b13[0].numel() + b2[0].numel()
    per_expert_b = 3 * H * inter * 2
    for key, size in (("q", per_expert_q), ("b", per_expert_b)):
        gbs = row["experts_hit"] * size / row[f"us_{key}"] / 1e3
        row[f"gbs_{key}"], row[f"pct_{key}"] = gbs, 100 * gbs / copy_gbs
    return row


def exact_values(blocks: torch.Tensor, qtype: int, like: torch.Tensor) -> torch.Tensor:
    """float32 values of stacked blocks, exactly (gguf's numpy dequantizer)."""
    flat = blocks.cpu().numpy().reshape(-1, blocks.shape[-1])
    return torch.from_numpy(dequantize(flat, qtype)).reshape(like.shape).cuda()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 2048])
    ap.add_argument("--types", nargs="+", default=["Q4_K/Q6_K", "Q8_0/Q8_0", "Q4_0/Q4_0"],
                    help="gate-up/down GGUF type pairs")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    E, K, H, inter = args.experts, args.top_k, args.hidden, args.intermediate
    copy_gbs = d2d_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name()}  E={E} K={K} H={H} I={inter}  "
          f"D2D copy {copy_gbs:,.0f} GB/s")
    head = (f"{'types':>10} {'T':>5} {'experts':>8} {'gguf us':>8} {'GB/s':>6} {'% copy':>7} "
            f"{'bf16 us':>8} {'GB/s':>6} {'% copy':>7} {'gguf err':>9} {'bf16 err':>9}")
    print(head)
    print("-" * len(head))
    for pair in args.types:
        try:
            q13, q2 = (TYPE_IDS[name] for name in pair.split("/"))
        except KeyError:
            raise SystemExit(f"--types: {pair!r} is not GATEUP/DOWN of {', '.join(TYPE_IDS)}")
        rng = np.random.default_rng(0)
        w13 = experts(q13, E, 2 * inter, H, rng)
        w2 = experts(q2, E, H, inter, rng)
        for T in args.tokens:
            r = bench(T, E, K, H, inter, q13, q2, w13, w2, copy_gbs)
            print(f"{pair:>10} {T:>5} {r['experts_hit']:>8} {r['us_q']:>8.1f} "
                  f"{r['gbs_q']:>6.0f} {r['pct_q']:>6.1f}% {r['us_b']:>8.1f} {r['gbs_b']:>6.0f} "
                  f"{r['pct_b']:>6.1f}% {r['err_q']:>9.1e} {r['err_b']:>9.1e}")
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
