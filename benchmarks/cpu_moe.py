"""CPU MoE kernel benchmark: one MoE layer's routed experts (moe_experts / moe_experts_quant /
moe_experts_scaled) at decode (T=1) and prefill (T=64), beside the memory bandwidth of a plain
large copy measured in the same run.

Shapes: a Qwen3-30B-A3B-like layer (hidden 2048, moe_intermediate 768, 128 experts, top-8) and
a small one (512, 256, 32, top-4); weights f32 (what an FP8 checkpoint became on the CPU before
its kernel), bf16, FP8 e4m3 in 128x128 scale blocks, Q8_0 and Q4_0. Every call routes the tokens
anew (random logits through moe_topk_softmax), and the layer is copied until the copies exceed
the last-level cache, so expert weights come from memory as in a model. GB/s counts the bytes
of the distinct experts a call touches, beside the copy's memory traffic (every byte copied is
read once and written once). "cpu" is the CPU time of all threads per call (best): on a shared
machine it shows the work a call needs when wall times are stretched by other load.

    python benchmarks/cpu_moe.py [--threads N] [--reps 20] [--max-mib 1024]
        [--shapes qwen,small] [--formats f32,bf16,fp8,q8_0,q4_0] [--tokens 1,64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import tvm_ffi

from freetoken.kernel import ops
from freetoken.kernel.loader import get_function

SHAPES = {"qwen": (2048, 768, 128, 8), "small": (512, 256, 32, 4)}   # H, I, E, K
# format -> (GGML type, bytes per 32 weights); f32 goes through moe_experts, fp8 (no GGML
# type) through moe_experts_scaled with a float32 scale per 128x128 block
FORMATS = {"f32": (0, 128), "bf16": (30, 64), "fp8": (None, 32), "q8_0": (8, 34),
           "q4_0": (2, 18)}
FP8_BLOCK = 128
COPY_MIB = 512
MEMORY_MIB = 256          # at least this much distinct weight memory, so reads miss the caches


def timed(fn, reps: int) -> tuple[float, float, float]:
    """(median, best) wall seconds per call and the best CPU seconds (all threads) per call; on
    a shared machine the best is the least contended figure."""
    fn()
    times, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(times), min(times), min(cpu)


def copy_bandwidth(threads: int, reps: int) -> tuple[float, float]:
    """Best bytes-copied-per-second of a COPY_MIB copy: numpy (one thread), torch (`threads`)."""
    src = np.ones(COPY_MIB << 18, dtype=np.float32)
    dst = np.empty_like(src)
    _, np_best, _ = timed(lambda: np.copyto(dst, src), reps)
    torch.set_num_threads(threads)
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    _, torch_best, _ = timed(lambda: tdst.copy_(tsrc), reps)
    return src.nbytes / np_best, src.nbytes / torch_best


def random_rows(shape: tuple[int, ...], fmt: str, rng: np.random.Generator) -> np.ndarray:
    """Weights of `shape` (last dim = weights per row) as f32, or GGUF rows of random bytes whose
    f16 block scales are set to a normal value (random scale bits could be inf or subnormal)."""
    if fmt == "f32":
        return rng.standard_normal(shape, dtype=np.float32) * 0.02
    if fmt == "bf16":
        values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(
            *shape[:-1], -1)
    if fmt == "fp8":        # any finite e4m3 code (0x7F and 0xFF are NaN)
        codes = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
        return codes | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)
    _, block = FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 32, block), dtype=np.uint8)
    blocks[..., :2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def expert_bytes(h: int, i: int, fmt: str) -> int:
    grids = 0
    if fmt == "fp8":        # float32 grids over gate/up [2I, H] and down [H, I]
        blocks = lambda rows, cols: -(-rows // FP8_BLOCK) * -(-cols // FP8_BLOCK)
        grids = 4 * (blocks(2 * i, h) + blocks(h, i))
    return 3 * h * i // 32 * FORMATS[fmt][1] + grids


def fp8_scales(slots: int, rows: int, cols: int) -> tuple:
    """A block grid of 1/64 (codes up to 448 give weights up to 7) and row scales of ones."""
    grid = torch.full((slots, -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), 1 / 64)
    return tvm_ffi.from_dlpack(grid), tvm_ffi.from_dlpack(torch.ones(slots, rows))


def make_layers(h, i, e, fmt, max_mib, rng):
    """(layer copies [(w13, w2)], slots per copy): copies until MEMORY_MIB, slots capped so one
    copy fits in max_mib (experts then share slots: expert_map = e % slots)."""
    per_expert = expert_bytes(h, i, fmt)
    slots = max(1, min(e, (max_mib << 20) // per_expert))
    copies = max(1, min(64, (MEMORY_MIB << 20) // (slots * per_expert)))
    layers = [(random_rows((slots, 2 * i, h), fmt, rng), random_rows((slots, h, i), fmt, rng))
              for _ in range(copies)]
    return layers, slots


def routings(t: int, e: int, k: int, slots: int, count: int, rng):
    """`count` routings through the routing kernel: (topk_ids, topk_weights, distinct slots)."""
    out = []
    for _ in range(count):
        logits = torch.from_numpy(rng.standard_normal((t, e), dtype=np.float32))
        weights, ids = torch.empty(t, k), torch.empty(t, k, dtype=torch.int32)
        ops.moe_topk_softmax(weights, ids, logits, True)
        out.append((ids, weights, len(np.unique(ids.numpy() % slots))))
    return out


def bench_case(name, fmt, t, args, rng) -> None:
    h, i, e, k = SHAPES[name]
    layers, slots = make_layers(h, i, e, fmt, args.max_mib, rng)
    expert_map = tvm_ffi.from_dlpack(torch.arange(e, dtype=torch.int32) % slots)
    ffi_layers = [tuple(tvm_ffi.from_dlpack(torch.from_numpy(w)) for w in layer) for layer in layers]
    routes = [(tvm_ffi.from_dlpack(ids), tvm_ffi.from_dlpack(w), n)
              for ids, w, n in routings(t, e, k, slots, 16, rng)]
    x = tvm_ffi.from_dlpack(torch.randn(t, h))
    out = tvm_ffi.from_dlpack(torch.empty(t, h))
    workspace = tvm_ffi.from_dlpack(torch.empty(0, dtype=torch.uint8))
    qtype = FORMATS[fmt][0]
    experts = get_function("moe", "moe_experts", "cpu")
    quant = get_function("moe", "moe_experts_quant", "cpu")
    fp8 = get_function("moe_scaled", "moe_experts_scaled", "cpu")
    grids = (fp8_scales(slots, 2 * i, h), fp8_scales(slots, h, i)) if fmt == "fp8" else None
    step = iter(range(1 << 62))
    touched = []

    def call():
        n = next(step)
        w13, w2 = ffi_layers[n % len(ffi_layers)]
        ids, weights, distinct = routes[n % len(routes)]
        touched.append(distinct)
        if fmt == "f32":
            experts(out, x, w13, w2, ids, weights, expert_map, workspace)
        elif fmt == "fp8":
            fp8(out, x, w13, *grids[0], w2, *grids[1], 0, FP8_BLOCK, FP8_BLOCK, FP8_BLOCK,
                FP8_BLOCK, ids, weights, expert_map, workspace)
        else:
            quant(out, x, w13, w2, qtype, qtype, ids, weights, expert_map, workspace)

    median, best, cpu = timed(call, args.reps)
    moved = statistics.mean(touched) * expert_bytes(h, i, fmt)
    note = "" if slots == e else f" ({slots} of {e} slots resident)"
    print(f"  {name:5s} {fmt:5s} T={t:<3d} {median * 1e3:8.3f} ms (best {best * 1e3:7.3f}, "
          f"cpu {cpu * 1e3:7.3f})  {moved / 1e6:7.1f} MB of experts  {moved / median / 1e9:6.2f} "
          f"GB/s (best {moved / best / 1e9:6.2f} = {moved / best / args.copy_traffic:4.0%} of "
          f"the copy's traffic){note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-mib", type=int, default=1024, help="memory for one layer's experts")
    parser.add_argument("--shapes", default="qwen,small")
    parser.add_argument("--formats", default="f32,bf16,fp8,q8_0,q4_0")
    parser.add_argument("--tokens", default="1,64")
    args = parser.parse_args()
    threads = get_function("quant_gemm", "set_num_threads", "cpu")(args.threads)
    print(f"cpu_isa={ops.cpu_isa()} threads={threads} torch={torch.__version__}")
    np_bw, torch_bw = copy_bandwidth(threads, max(5, args.reps // 2))
    args.copy_traffic = 2 * max(np_bw, torch_bw)   # a copy reads and writes every byte
    print(f"copy {COPY_MIB} MiB: numpy 1 thread {np_bw / 1e9:.2f} GB/s, torch {threads} threads "
          f"{torch_bw / 1e9:.2f} GB/s copied -> memory traffic (read + write) "
          f"{args.copy_traffic / 1e9:.2f} GB/s")
    rng = np.random.default_rng(0)
    for name in args.shapes.split(","):
        h, i, e, k = SHAPES[name]
        print(f"{name}: hidden {h}, intermediate {i}, {e} experts, top-{k}")
        for fmt in args.formats.split(","):
            for t in (int(v) for v in args.tokens.split(",")):
                bench_case(name, fmt, t, args, rng)


if __name__ == "__main__":
    main()
