"""The gated delta rule's prefill on the GPU at Qwen3.6-35B-A3B's GDN shapes (16 key / 32 value
heads of 128): the chunked kernel (one call of T tokens) against the sequential one (the same
tokens in calls of 64 // batch a sequence, which the chunk rule leaves to it), per layer, and their largest
output difference.

    python benchmarks/gpu_gdn_prefill.py [--tokens 512,2048] [--batch 1]

Times are CUDA-event milliseconds (median of 7, after a warm-up), launches included.
"""

from __future__ import annotations

import argparse
import json

import torch

from freetoken.kernel import ops

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(tokens: int, batch: int):
    gen = torch.Generator().manual_seed(0)
    n = tokens * batch
    qkv = torch.randn(n, 2 * HK * DK + HV * DV, generator=gen).to(torch.bfloat16).cuda()
    ba = torch.randn(n, 2 * HV, generator=gen).to(torch.bfloat16).cuda()
    a_log = torch.linspace(-2, 1, HV).cuda()
    dt_bias = (0.3 * torch.randn(HV, generator=gen)).cuda()
    return qkv, ba, a_log, dt_bias


def run(qkv, ba, a_log, dt_bias, tokens: int, batch: int, split: int):
    """Every sequence's `tokens` from position 0, `split` tokens per sequence a call."""
    out = torch.empty(qkv.shape[0], HV * DV, dtype=qkv.dtype, device="cuda")
    state = torch.empty(batch, HV, DK, DV, dtype=torch.float32, device="cuda")
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    calls = []
    for c0 in range(0, tokens, split):
        n = min(split, tokens - c0)
        rows = (torch.arange(batch, device="cuda")[:, None] * tokens
                + torch.arange(c0, c0 + n, device="cuda")[None, :]).reshape(-1)
        pos = torch.arange(c0, c0 + n, device="cuda").repeat(batch)
        qs = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * n
        calls.append((rows, qkv[rows], ba[rows], pos, qs, torch.empty(len(rows), HV * DV,
                                                                      dtype=qkv.dtype,
                                                                      device="cuda")))

    def go():
        for rows, q, b, pos, qs, part in calls:
            ops.gdn_recurrence(part, q, b, a_log, dt_bias, state, pos, qs, slots)
    go()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        go()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    for rows, _, _, _, _, part in calls:
        out[rows] = part
    return sorted(times)[3], out, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        data = inputs(tokens, args.batch)
        chunked_ms, out_c, state_c = run(*data, tokens, args.batch, tokens)
        # calls of 64 // batch tokens a sequence: fewer than 64 more tokens than sequences
        seq_ms, out_s, state_s = run(*data, tokens, args.batch, max(1, 64 // args.batch))
        rows.append({"tokens": tokens, "batch": args.batch, "chunked_ms": round(chunked_ms, 3),
                     "sequential_ms": round(seq_ms, 3),
                     "speedup": round(seq_ms / chunked_ms, 2),
                     "max_out_diff": float((out_c.float() - out_s.float()).abs().max()),
                     "max_state_diff": float((state_c - state_s).abs().max())})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
