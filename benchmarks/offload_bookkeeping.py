"""Host time the expert cache spends per MoE layer of a decode step (routing ids in, LRU
look-ups, the slot map written), with every expert cached and a no-op experts kernel: the
floor an offloaded decode step pays per MoE layer on top of the GPU's own work and the sync.
Both paths: eager steps (`run`) and decode graph segments (`prepare_segment`, what runs
between two replays; the map is uploaded only when a routed slot changed).

    python benchmarks/offload_bookkeeping.py [--experts 128] [--top-k 8] [--layers 48]

CPU only (torch CPU tensors stand in for the GPU pool); median of 5 passes over 64 steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.engine.expert_cache import ExpertCache
from freetoken.engine.expert_pool import FloatPool


def per_layer_us(experts: int, top_k: int, layers: int, batch: int,
                 segments: bool = False) -> float:
    w13 = [torch.zeros(experts, 2, 1) for _ in range(layers)]
    w2 = [torch.zeros(experts, 1, 1) for _ in range(layers)]
    cache = ExpertCache(FloatPool(w13, w2, lambda *args: None), "cpu", experts * layers)
    cache.prefill = False
    g = torch.Generator().manual_seed(0)
    steps = [torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch)])
             .int() for _ in range(64)]
    x, w, out, ws = torch.zeros(batch, 1), torch.ones(batch, top_k), torch.zeros(batch, 1), \
        torch.empty(0)
    times = []
    for _ in range(6):                       # the first pass fills the cache
        start = time.perf_counter()
        for ids in steps:
            for layer in range(layers):
                if segments:
                    cache.prepare_segment(layer, ids)
                else:
                    cache.run(layer, out, x, ids, w, ws)
        times.append((time.perf_counter() - start) / (len(steps) * layers))
    return 1e6 * statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()
    for segments in (False, True):
        for batch in (1, 8, 32):
            us = per_layer_us(args.experts, args.top_k, args.layers, batch, segments)
            print(f"{'graph segments' if segments else 'eager':>14} batch {batch:3d}: "
                  f"{us:6.1f} us per MoE layer, {us * args.layers / 1e3:6.2f} ms per step over "
                  f"{args.layers} layers")


if __name__ == "__main__":
    main()
