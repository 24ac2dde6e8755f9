"""The fused decode kernels against the unfused chain they replace, per projection shape and
token count, on one GPU: GPU time (CUDA events, median of 200) and the share of HBM bandwidth
the weights' bytes reach.

    python benchmarks/decode_kernels.py [--tokens 1,2,4,8]

Shapes: SmolLM2-135M and Qwen3-8B projections. Per row: the decode GEMV (with its norm prologue
or its epilogue) vs torch's mm (cuBLAS) + the separate norm / add / SiLU-and-mul kernels. This is
the measurement behind fused_decode.MAX_TOKENS and NORM_IN_PROLOGUE_TOKENS.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402

# name: (rows N, K); "gate_up" rows are 2I
SHAPES = {
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536), "qwen3-8b qkv": (6144, 4096), "qwen3-8b o": (4096, 4096),
    "qwen3-8b gate_up": (24576, 4096), "qwen3-8b down": (4096, 12288),
}


def gpu_ms(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[reps // 2]


def pair(name: str, t: int, sms: int):
    """(fused, unfused) callables for one projection at t tokens."""
    from freetoken.kernel import ops
    from freetoken.models.forward.fused_decode import NORM_IN_PROLOGUE_TOKENS, gemv_group

    n, k = SHAPES[name]
    dev, bf = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=bf) / k ** 0.5
    x, norm = torch.randn(t, k, device=dev, dtype=bf), torch.ones(k, device=dev, dtype=bf)
    xn = torch.empty_like(x)
    kind = name.split()[1]
    if kind in ("o", "down"):
        res, out = torch.randn(t, n, device=dev, dtype=bf), torch.empty(t, n, device=dev, dtype=bf)
        g = gemv_group(n, k, sms)
        return (lambda: ops.decode_gemv_add(res, x, w, g),
                lambda: (torch.mm(x, w.T, out=out), res.add_(out)))
    prologue = norm if t <= NORM_IN_PROLOGUE_TOKENS else None
    if kind == "qkv":
        out = torch.empty(t, n, device=dev, dtype=bf)
        g = gemv_group(n, k, sms)

        def fused():
            if prologue is None:
                ops.rms_norm(xn, x, norm, 1e-6)
            ops.decode_gemv(out, xn if prologue is None else x, w, None, prologue, 1e-6, g)
        return fused, lambda: (ops.rms_norm(xn, x, norm, 1e-6), torch.mm(xn, w.T, out=out))
    act, gu = torch.empty(t, n // 2, device=dev, dtype=bf), torch.empty(t, n, device=dev, dtype=bf)
    g = gemv_group(n // 2, k, sms)

    def fused_mlp():
        if prologue is None:
            ops.rms_norm(xn, x, norm, 1e-6)
        ops.decode_gemv_swiglu(act, xn if prologue is None else x, w, prologue, 1e-6, g)
    return fused_mlp, lambda: (ops.rms_norm(xn, x, norm, 1e-6), torch.mm(xn, w.T, out=gu),
                               ops.silu_and_mul(act, gu))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8")
    args = p.parse_args()
    bandwidth = d2d_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"D2D bandwidth {bandwidth / 1e12:.2f} TB/s, {sms} SMs")
    print(f"{'projection':18}{'T':>3}{'fused us':>10}{'unfused us':>12}{'speed-up':>10}"
          f"{'fused % BW':>12}")
    for name, (n, k) in SHAPES.items():
        for t in (int(v) for v in args.tokens.split(",")):
            fused, unfused = pair(name, t, sms)
            a, b = gpu_ms(fused), gpu_ms(unfused)
            pct = 100 * (2 * n * k / (a / 1e3)) / bandwidth
            print(f"{name:18}{t:3}{a * 1e3:10.1f}{b * 1e3:12.1f}{b / a:10.2f}{pct:11.0f}%",
                  flush=True)


if __name__ == "__main__":
    main()
