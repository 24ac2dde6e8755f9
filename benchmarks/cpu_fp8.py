"""CPU FP8 projection benchmark: scaled_gemv over e4m3 weights with 128x128 scale blocks beside
float_matmul over the same shape in float32 (what an FP8 checkpoint became on the CPU before
its kernel) and bf16, at decode batch sizes.

Each weight is copied until the copies exceed the last-level cache, so every call reads its
weight from memory as a model's layers do. GB/s counts the bytes of the weight a call reads.

    python benchmarks/cpu_fp8.py [--threads N] [--reps 20] [--shapes 4096x4096,2048x768]
        [--tokens 1,4,8]
"""

from __future__ import annotations

import argparse
import time

import torch

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function

MEMORY_BYTES = 256 << 20     # distinct weight memory per format: beyond any cache
BLOCK = 128


def best_seconds(fn, reps: int) -> float:
    fn(0)
    best = float("inf")
    for rep in range(reps):
        start = time.perf_counter()
        fn(rep)
        best = min(best, time.perf_counter() - start)
    return best


def copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, MEMORY_BYTES // nbytes))]


def bench_shape(n: int, k: int, tokens: int, reps: int) -> None:
    codes = copies(lambda: torch.randint(0, 0x7F, (n, k), dtype=torch.uint8), n * k)
    grid = torch.full((-(-n // BLOCK), -(-k // BLOCK)), 1 / 64)
    rows = torch.ones(n)
    f32 = copies(lambda: torch.randn(n, k) * 0.02, 4 * n * k)
    bf16 = copies(lambda: (torch.randn(n, k) * 0.02).to(torch.bfloat16), 2 * n * k)
    x, out = torch.randn(tokens, k), torch.empty(tokens, n)
    cases = (
        ("fp8", n * k + 4 * grid.numel(),
         lambda r: ops.scaled_gemv(out, x, codes[r % len(codes)], grid, rows, 0, BLOCK, BLOCK)),
        ("f32", 4 * n * k, lambda r: ops.float_matmul(out, x, f32[r % len(f32)])),
        ("bf16", 2 * n * k, lambda r: ops.float_matmul(out, x, bf16[r % len(bf16)])),
    )
    timings = {name: (nbytes, best_seconds(fn, reps)) for name, nbytes, fn in cases}
    f32_s = timings["f32"][1]
    for name, (nbytes, seconds) in timings.items():
        print(f"  {n}x{k} T={tokens:<2d} {name:4s} {seconds * 1e3:7.3f} ms  "
              f"{nbytes / seconds / 1e9:6.2f} GB/s  {f32_s / seconds:5.2f}x f32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--shapes", default="4096x4096,2048x768")
    parser.add_argument("--tokens", default="1,4,8")
    args = parser.parse_args()
    threads = get_function("quant_gemm", "set_num_threads", "cpu")(args.threads)
    print(f"cpu_isa={ops.cpu_isa()} threads={threads} torch={torch.__version__}")
    try:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
        tokens = [int(v) for v in args.tokens.split(",")]
    except ValueError:
        parser.error("--shapes takes NxK[,NxK...] and --tokens T[,T...], all integers")
    if any(len(s) != 2 or min(s) < 1 or s[1] % 8 for s in shapes) or min(tokens) < 1:
        parser.error("each shape is NxK with N >= 1 and K a positive multiple of 8; tokens >= 1")
    for n, k in shapes:
        for count in tokens:
            bench_shape(n, k, count, args.reps)


if __name__ == "__main__":
    main()
