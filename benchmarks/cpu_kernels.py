"""CPU kernel benchmark: quantized matmuls of SmolLM2-135M per ISA, plus decode attention.

Times quant_matmul at M=1 (decode) for every weight shape of the model (Q4_1 layers, Q8_0 tied
head), reports GB/s of weights read and the matmul time per decoded token for the 30-layer
model; then the same at M=64 (prefill), and paged attention at decode.

    python benchmarks/cpu_kernels.py [--threads N] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from freetoken.kernel import ops
from freetoken.kernel import reference as ref
from freetoken.kernel.loader import get_function

LAYERS = 30
# name, K, N, qtype, uses per token
SHAPES = (
    ("qkv 576->960", 576, 960, ref.Q4_1, LAYERS),
    ("o 576->576", 576, 576, ref.Q4_1, LAYERS),
    ("gate_up 576->3072", 576, 3072, ref.Q4_1, LAYERS),
    ("down 1536->576", 1536, 576, ref.Q4_1, LAYERS),
    ("head 576->49152 Q8_0", 576, 49152, ref.Q8_0, 1),
)
ISAS = ("scalar", "avx2", "avx512")


def timed(fn, reps: int) -> tuple[float, float]:
    """(median, best) seconds per call; on a shared machine the best is the uncontended figure."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def weight_copies(k: int, n: int, qtype: int, uses: int) -> list[torch.Tensor]:
    """Distinct weight matrices (up to the layer count, ~100 MB in all) so that a decode step's
    reads come from memory, as in the model, not from a cache warmed by the previous rep."""
    one = ref.quantize(torch.randn(n, k), qtype)
    copies = max(1, min(uses, 100_000_000 // one.numel()))
    return [one] + [one.clone() for _ in range(copies - 1)]


def bench_matmul(isa: str, m: int, reps: int) -> tuple[float, float]:
    """Per-token seconds of all matmuls (median-based, best-based)."""
    run = get_function("quant_gemm", "quant_matmul_isa", "cpu")
    total = best_total = 0.0
    for name, k, n, qtype, uses in SHAPES:
        weights = weight_copies(k, n, qtype, uses)
        x, out = torch.randn(m, k), torch.empty(m, n)
        step = iter(range(1 << 62))

        def call():
            run(out, x, weights[next(step) % len(weights)], qtype, isa)

        seconds, best = timed(call, reps if isa != "scalar" else max(3, reps // 10))
        total += seconds * uses
        best_total += best * uses
        gbs, best_gbs = (weights[0].numel() / t / 1e9 for t in (seconds, best))
        print(f"  {isa:7s} M={m:<3d} {name:22s} {seconds * 1e6:9.1f} us  {gbs:6.2f} GB/s "
              f"(best {best * 1e6:.1f} us, {best_gbs:.2f} GB/s)")
    return total, best_total


def bench_attention(context: int, cache_dtype: torch.dtype, reps: int) -> float:
    hq, hk, d, bs = 9, 3, 64, 16
    blocks = (context + bs - 1) // bs
    k_cache = torch.randn(blocks * bs, hk, d).to(cache_dtype)
    v_cache = torch.randn(blocks * bs, hk, d).to(cache_dtype)
    q, out = torch.randn(1, hq, d), torch.empty(1, hq, d)
    tables = torch.randperm(blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([context], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    return timed(lambda: ops.paged_attention(out, q, k_cache, v_cache, tables, seq_lens, qsl, bs,
                                             d ** -0.5), reps)


def decode_step_seconds(context: int, reps: int) -> float:
    """One decoded token of the 30-layer model with random weights: every kernel in order."""
    hidden, ffn, hq, hk, d, bs = 576, 1536, 9, 3, 64, 16
    layers = [{name: ref.quantize(torch.randn(n, k), ref.Q4_1) for name, k, n in
               (("qkv", hidden, (hq + 2 * hk) * d), ("o", hidden, hidden),
                ("gate_up", hidden, 2 * ffn), ("down", ffn, hidden))} for _ in range(LAYERS)]
    head = ref.quantize(torch.randn(49152, hidden), ref.Q8_0)
    blocks = context // bs + 1
    caches = [(torch.randn(blocks * bs, hk, d), torch.randn(blocks * bs, hk, d)) for _ in range(LAYERS)]
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    seq_lens, qsl = torch.tensor([context], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    pos, slot = torch.tensor([context - 1]), torch.tensor([context - 1])
    cos_sin = torch.randn(context, d)
    x, res, norm_w = torch.randn(1, hidden), torch.randn(1, hidden), torch.ones(hidden)
    qkv, attn = torch.empty(1, (hq + 2 * hk) * d), torch.empty(1, hq, d)
    gate_up, act, logits = torch.empty(1, 2 * ffn), torch.empty(1, ffn), torch.empty(1, 49152)
    h = torch.empty(1, hidden)

    def step():
        for w, (kc, vc) in zip(layers, caches):
            ops.fused_add_rms_norm(x, res, norm_w, 1e-5)
            ops.quant_matmul(qkv, x, w["qkv"], ref.Q4_1)
            q, k, v = qkv[:, : hq * d], qkv[:, hq * d: (hq + hk) * d], qkv[:, (hq + hk) * d:]
            ops.rotary_embedding(pos, q, k, cos_sin, d, True)
            ops.store_kv(k.view(1, hk, d), v.view(1, hk, d), kc, vc, slot)
            ops.paged_attention(attn, q.view(1, hq, d), kc, vc, tables, seq_lens, qsl, bs, 0.125)
            ops.quant_matmul(h, attn.view(1, -1), w["o"], ref.Q4_1)
            ops.fused_add_rms_norm(h, res, norm_w, 1e-5)
            ops.quant_matmul(gate_up, h, w["gate_up"], ref.Q4_1)
            ops.silu_and_mul(act, gate_up)
            ops.quant_matmul(x, act, w["down"], ref.Q4_1)
        ops.fused_add_rms_norm(x, res, norm_w, 1e-5)
        ops.quant_matmul(logits, x, head, ref.Q8_0)

    return timed(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0 = all cores)")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    threads = [get_function(k, "set_num_threads", "cpu")(args.threads)
               for k in ("quant_gemm", "attention")][0]
    best = ops.cpu_isa()
    isas = ISAS[: ISAS.index(best) + 1]
    print(f"cpu_isa={best} threads={threads} torch={torch.__version__}")
    layer_bytes = sum(ref.quantize(torch.zeros(n, k), q).numel() * u for _, k, n, q, u in SHAPES)
    print(f"weights read per decoded token: {layer_bytes / 1e6:.1f} MB")
    for isa in isas:
        for label, t in zip(("median", "best"), bench_matmul(isa, 1, args.reps)):
            print(f"  {isa} decode matmuls ({label}): {t * 1e3:.2f} ms/token, "
                  f"{layer_bytes / t / 1e9:.2f} GB/s -> at most {1 / t:.0f} tok/s")
    for isa in isas[-1:]:
        for label, t in zip(("median", "best"), bench_matmul(isa, 64, max(5, args.reps // 5))):
            print(f"  {isa} prefill matmuls ({label}): {t / 64 * 1e3:.3f} ms/token "
                  f"-> at most {64 / t:.0f} prompt tok/s")
    for context in (128, 512):
        med, best = decode_step_seconds(context, max(5, args.reps // 5))
        print(f"  decode step, all kernels, context {context}: median {med * 1e3:.2f} ms "
              f"({1 / med:.0f} tok/s), best {best * 1e3:.2f} ms ({1 / best:.0f} tok/s)")
    for context in (128, 512, 2048):
        for dtype in (torch.float32, torch.float16):
            med, best = bench_attention(context, dtype, args.reps)
            print(f"  attention decode ctx={context:<5d} {str(dtype):14s} median {med * 1e6:7.1f} "
                  f"us/layer, best {best * 1e6:7.1f} -> {med * LAYERS * 1e3:.2f} ms/token")


if __name__ == "__main__":
    main()
