"""The MoE decode halves over GGUF experts (moe_q8_gate_up, moe_q8_down) per launch shape, on
one GPU: GPU time per layer (CUDA graph replay between CUDA events, median) and the bytes of the
routed experts' blocks that layer reads over that time, beside the D2D copy bandwidth measured
in the same run.

    python benchmarks/moe_q8_sweep.py [--tokens 1,8,32] [--layers 8] [--reps 30]

Shapes: Qwen3-30B-A3B's and Qwen3.6-35B-A3B's experts in their Q4_K_M types (Q4_K gate/up, Q4_K
or Q6_K down, rows padded to 16-byte words as the loader keeps them), random zero-mean blocks.
For each token count and each Q4_K rows-per-warp value of the halves (models/forward/
moe_decode_quant.py GATE_UP_ROWS / DOWN_ROWS), `--layers` layers with their own experts run in
one graph, so one layer's blocks are not in L2 for the next; the routes are random top-k ids.
Bytes per layer: the distinct experts the routes reach (what a step must read at least: the
rate column), and every (pair, expert) gate/up read and every (token, expert) down read the
kernels make (the "reads" column), at the blocks' bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth, replay_ms  # noqa: E402

Q4_K, Q6_K = 12, 14
# name: (hidden, experts, inter, top_k)
SHAPES = {"Qwen3-30B-A3B": (2048, 128, 768, 8), "Qwen3.6-35B-A3B": (2048, 256, 512, 8)}
ROWS = (1, 2)


def _experts(rows: int, cols: int, experts: int, qtype: int, rng) -> torch.Tensor:
    from freetoken.models.checkpoint.weights import gpu_rows
    from tests.kernel.gguf_random import random_blocks

    one = gpu_rows(random_blocks(qtype, rows, cols, rng, centered=True))
    # the same bytes for every expert keep the set-up short; the kernel reads each one apart
    return torch.from_numpy(np.ascontiguousarray(np.broadcast_to(one, (experts, *one.shape)))
                            ).cuda()


def _time(fn, reps: int) -> float:
    """Median ms of one replay of a graph of fn."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, reps)


def sweep(name: str, tokens: int, q2: int, layers: int, reps: int, bandwidth: float) -> None:
    from freetoken.kernel import ops

    h, e, inter, k = SHAPES[name]
    rng = np.random.default_rng(tokens)
    w13 = [_experts(2 * inter, h, e, Q4_K, rng) for _ in range(layers)]
    w2 = [_experts(h, inter, e, q2, rng) for _ in range(layers)]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda", generator=gen)[:k]
                       for _ in range(tokens)]).to(torch.int32)
    wts = torch.rand(tokens, k, device="cuda", generator=gen)
    emap = torch.arange(e, device="cuda", dtype=torch.int32)
    act = torch.empty(tokens * k, inter, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(tokens, h, device="cuda", dtype=torch.bfloat16)
    distinct = len(torch.unique(ids))
    for rows in ROWS:
        def gate_up():
            for layer in range(layers):
                ops.moe_q8_gate_up(act, x, w13[layer], Q4_K, ids, emap, rows, True)

        def down():
            for layer in range(layers):
                ops.moe_q8_down(out, act, w2[layer], q2, ids, wts, emap, True, rows, True)

        halves = [("gate/up", gate_up, w13[0][0].nbytes), ("down", down, w2[0][0].nbytes)]
        for half, fn, expert_bytes in halves:
            ms = _time(fn, reps) / layers
            rate = distinct * expert_bytes / (ms * 1e-3)
            reads = tokens * k * expert_bytes / (ms * 1e-3)
            print(f"{name:16} T={tokens:<3} down {'Q6_K' if q2 == Q6_K else 'Q4_K'} "
                  f"{half:8} rows {rows}: {1e3 * ms:7.1f} us/layer  {rate / 1e12:5.2f} TB/s "
                  f"({100 * rate / (bandwidth / 2):4.0f}% of copy/2; reads "
                  f"{reads / 1e12:5.2f} TB/s), {distinct} experts", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,8,32")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    bandwidth = d2d_bandwidth()
    print(f"D2D copy bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            for q2 in (Q4_K, Q6_K):
                sweep(name, tokens, q2, args.layers, args.reps, bandwidth)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
