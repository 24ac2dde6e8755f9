"""Decode GEMVs over quantized weights, every variant: which one streams closest to the memory.

    python benchmarks/quant_gemv_sweep.py [--types q4_k,q6_k,q8_0,q4_0,fp8_block,fp8_channel,
        fp8_tensor] [--tokens 1,4,8] [--json out.json]

Qwen3-8B's projection shapes (fused qkv, o, fused gate/up, down, and a lone 1024-row k or v),
T = 1, 4, 8 activation rows, random weights: GGUF blocks with finite f16 scales
(tests/kernel/gguf_random.py) and FP8 e4m3 bytes with 128x128, per-channel and per-tensor
float32 scales. Variants: v1 (gguf_matmul / scaled_gemv) and v2 (gguf_gemv / fp8_gemv, the
default) at 1, 2 and 4 weight rows per warp, and at 1-2 tokens v3 (gguf_gemv_q8: int8
activations; for Q4_K at 1 and 2 rows per warp), plain and as a programmatic dependent launch. Each is timed as a CUDA graph of 20 launches
(CUDA events, median of 7) and reported as GB/s of quantized bytes read (blocks, or e4m3 bytes
plus scales) and as a percentage of the device-to-device copy rate (bytes read + written per
second, benchmarks/gpu_decode.py) measured in the same run: the decode byte ceiling.

Every output is checked against dequantize-then-matmul in float64 (GGUF dequantized by
gguf_dequantize_rows, FP8 by torch's float8 conversion times the expanded scales): the GEMV
rounds each of its K products and sums in float32, so the bound is 2 K eps32 |x| @ |W|.T plus
two roundings of the bf16 output. v3 is checked against its own int8 activations
(kernel/reference.py's quantize_activations) in place of x. A variant over the bound is reported as FAILED and never best.
The best variant per type and T is the one with the least time summed over the four shapes of
a layer. Under 3 minutes on an H200 once the kernels are built.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402
from benchmarks.gpu_quant import graph_time  # noqa: E402
from freetoken.kernel import reference  # noqa: E402
from freetoken.models.forward import quant_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288), "k|v": (1024, 4096)}
LAYER = ("qkv", "o", "gate_up", "down")
GGUF = {"q4_k": 12, "q6_k": 14, "q8_0": 8, "q4_0": 2}
FP8 = {"fp8_block": (128, 128), "fp8_channel": (1, None), "fp8_tensor": (None, None)}
VARIANTS = (("v1", None), ("v2/r1", 1), ("v2/r2", 2), ("v2/r4", 4))
Q8_VARIANTS = (("v3/r1", 1, False), ("v3/r2", 2, False), ("v3/r1+pdl", 1, True),
               ("v3/r2+pdl", 2, True))
EPS32, EPS_BF16 = 2.0 ** -23, 2.0 ** -7


def gguf_case(qtype: int, n: int, k: int):
    """(weight bytes, float64 weight, {variant: fn(out, x)})."""
    from freetoken.kernel import ops
    from tests.kernel.gguf_random import random_blocks

    blocks = torch.from_numpy(random_blocks(qtype, n, k, np.random.default_rng(n + k))).cuda()
    w = torch.empty(n, k, device="cuda", dtype=torch.float32)
    ops.gguf_dequantize_rows(w, torch.arange(n, device="cuda"), blocks, qtype)
    fns = {"v1": lambda o, x: ops.gguf_matmul(o, x, blocks, qtype)}
    for name, rows in VARIANTS[1:]:
        fns[name] = lambda o, x, r=rows: ops.gguf_gemv(o, x, blocks, qtype, r)
    if qtype in quant_gemv.Q8_BLOCKS:
        for name, rows, pdl in Q8_VARIANTS:
            if rows > 1 and qtype != 12:    # the staged types take one row per warp
                continue
            fns[name] = lambda o, x, r=rows, d=pdl: ops.gguf_gemv_q8(o, x, blocks, qtype, None,
                                                                      None, 0.0, 0, r, d)
    return blocks.nbytes, w.double(), fns


def fp8_case(block, n: int, k: int):
    from freetoken.kernel import ops

    bn, bk = block[0] or n, block[1] or k
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    data = torch.randint(0, 256, (n, k), device="cuda", dtype=torch.uint8, generator=gen)
    data[(data & 0x7F) == 0x7F] = 0x7E                     # no NaN codes
    grid = torch.rand(-(-n // bn), -(-k // bk), device="cuda", generator=gen) * 1e-4 + 5e-5
    row_scale = torch.ones(n, device="cuda")
    w = (data.view(torch.float8_e4m3fn).double()
         * grid.double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k])
    fns = {"v1": lambda o, x: ops.scaled_gemv(o, x, data, grid, row_scale, 0, bn, bk)}
    for name, rows in VARIANTS[1:]:
        fns[name] = lambda o, x, r=rows: ops.fp8_gemv(o, x, data, grid, row_scale, bn, bk, r)
    return data.nbytes + grid.nbytes, w, fns


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Worst error over its bound (<= 1 passes)."""
    xd = x.double()
    ref = xd @ w.T
    bound = 2 * x.shape[1] * EPS32 * (xd.abs() @ w.abs().T) + 2 * EPS_BF16 * ref.abs() + 1e-30
    return ((out.double() - ref).abs() / bound).max().item()


def sweep(types: list[str], tokens: list[int], copy_bw: float) -> list[dict]:
    rows = []
    for tname in types:
        for shape, (n, k) in SHAPES.items():
            nbytes, w, fns = (gguf_case(GGUF[tname], n, k) if tname in GGUF
                              else fp8_case(FP8[tname], n, k))
            for t in tokens:
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
                for variant, fn in fns.items():
                    x_ref = x
                    if variant.startswith("v3"):
                        if not quant_gemv.q8_reads(GGUF[tname], k, t):
                            continue
                        x_ref = reference.quantize_activations(x)
                    out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                    fn(out, x)
                    worst = check(out, x_ref, w)
                    sec = graph_time(lambda: fn(out, x))
                    rows.append({"type": tname, "shape": shape, "n": n, "k": k, "tokens": t,
                                 "variant": variant, "us": sec * 1e6,
                                 "GBps": nbytes / sec / 1e9,
                                 "pct_of_copy": 100 * nbytes / sec / copy_bw,
                                 "error_over_bound": worst, "ok": worst <= 1.0})
            del w, fns
            torch.cuda.empty_cache()
    return rows


def best(rows: list[dict]) -> list[dict]:
    """Per (type, tokens): each variant's time summed over a layer's shapes, the least wins."""
    out = []
    for key in sorted({(r["type"], r["tokens"]) for r in rows}):
        totals = {}
        for r in rows:
            if (r["type"], r["tokens"]) == key and r["shape"] in LAYER:
                us, ok = totals.get(r["variant"], (0.0, True))
                totals[r["variant"]] = (us + r["us"], ok and r["ok"])
        good = {v: us for v, (us, ok) in totals.items() if ok}
        win = min(good, key=good.get) if good else None
        out.append({"type": key[0], "tokens": key[1], "best": win,
                    "layer_us": {v: round(us, 1) for v, (us, _) in totals.items()},
                    "speedup_over_v1": (totals["v1"][0] / good[win]) if win else None})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default=",".join(list(GGUF) + list(FP8)))
    p.add_argument("--tokens", default="1,4,8")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    known = list(GGUF) + list(FP8)
    unknown = [t for t in types if t not in known]
    if unknown:
        p.error(f"--types: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    tokens = [int(t) for t in a.tokens.split(",")]
    if any(not 1 <= t <= 8 for t in tokens):
        p.error("--tokens: each between 1 and 8 (the decode GEMVs' range)")
    copy_bw = d2d_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    rows = sweep(types, tokens, copy_bw)
    print(f"{'type':12} {'shape':8} {'T':>2} {'variant':10} {'us':>8} {'GB/s':>7} {'%copy':>6}")
    for r in rows:
        flag = "" if r["ok"] else f"  FAILED ({r['error_over_bound']:.1f}x the bound)"
        print(f"{r['type']:12} {r['shape']:8} {r['tokens']:>2} {r['variant']:10} {r['us']:8.1f} "
              f"{r['GBps']:7.0f} {r['pct_of_copy']:6.1f}{flag}")
    winners = best(rows)
    print("\nbest per type and T (time over qkv + o + gate_up + down):")
    for b in winners:
        speed = f"{b['speedup_over_v1']:.2f}x v1" if b["speedup_over_v1"] else "none passed"
        print(f"  {b['type']:12} T={b['tokens']}: {b['best']}  ({speed}; {b['layer_us']})")
    if a.json:
        a.json.write_text(json.dumps({"copy_GBps": copy_bw / 1e9, "rows": rows,
                                      "best": winners}, indent=1))


if __name__ == "__main__":
    main()
