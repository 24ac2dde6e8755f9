"""CPU kernel benchmark: every kernel of a SmolLM2-135M decode step, per ISA.

Times quant_matmul at M=1 (decode) for every weight shape of the model (Q4_1 layers, Q8_0 tied
head) with GB/s of weights read; every other op the forward calls at decode shapes (us per call
and ms per token); the kernel total per decoded token; then matmuls at M=64 (prefill), a whole
decode step and paged attention at longer contexts.

    python benchmarks/cpu_kernels.py [--threads N] [--reps 50] [--sections ops,matmul,...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import tvm_ffi

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
SECTIONS = ("ops", "matmul", "prefill", "step", "attention")
HIDDEN, FFN, HQ, HK, HEAD_DIM, BLOCK = 576, 1536, 9, 3, 64, 16


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
        ffi_weights = [tvm_ffi.from_dlpack(w) for w in weights]
        x, out = tvm_ffi.from_dlpack(torch.randn(m, k)), tvm_ffi.from_dlpack(torch.empty(m, n))
        step = iter(range(1 << 62))

        def call():
            run(out, x, ffi_weights[next(step) % len(ffi_weights)], qtype, isa)

        seconds, best = timed(call, reps if isa != "scalar" else max(3, reps // 10))
        total += seconds * uses
        best_total += best * uses
        gbs, best_gbs = (weights[0].numel() / t / 1e9 for t in (seconds, best))
        print(f"  {isa:7s} M={m:<3d} {name:22s} {seconds * 1e6:9.1f} us  {gbs:6.2f} GB/s "
              f"(best {best * 1e6:.1f} us, {best_gbs:.2f} GB/s)")
    return total, best_total


def token_matmul_seconds(reps: int) -> tuple[float, float]:
    """Best (layers, head) seconds of one decode token's matmuls in model order: 30 layers of
    distinct weights, then the head, so every weight comes from memory as in the model."""
    run, ffi = get_function("quant_gemm", "quant_matmul", "cpu"), tvm_ffi.from_dlpack
    calls = []
    for name, k, n, qtype, uses in SHAPES[:-1]:
        one = ref.quantize(torch.randn(n, k), qtype)
        calls.append([(ffi(torch.empty(1, n)), ffi(torch.randn(1, k)), ffi(one.clone()), qtype)
                      for _ in range(uses)])
    layers = [args for layer in zip(*calls) for args in layer]
    _, k, n, qtype, _ = SHAPES[-1]
    head_weight = ffi(ref.quantize(torch.randn(n, k), qtype))
    head = (ffi(torch.empty(1, n)), ffi(torch.randn(1, k)), head_weight, qtype)
    best_layers = best_head = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for args in layers:
            run(*args)
        middle = time.perf_counter()
        run(*head)
        end = time.perf_counter()
        best_layers, best_head = min(best_layers, middle - start), min(best_head, end - middle)
    return best_layers, best_head


def per_call_seconds(fn, args: tuple, reps: int) -> float:
    """Best of five mean times of `reps` back-to-back calls (tvm_ffi arguments: little Python)."""
    fn(*args)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def decode_op_cases() -> list[tuple[str, int, str, str, tuple]]:
    """(label, calls per token, kernel, function, torch args) of every non-matmul op of one
    SmolLM2-135M decode token (see runtime/freetoken/models/forward/decoder.py for the sequence)."""
    q_width, kv_width = HQ * HEAD_DIM, HK * HEAD_DIM
    x, res, w = torch.randn(1, HIDDEN), torch.randn(1, HIDDEN), torch.rand(HIDDEN) + 0.5
    qkv = torch.randn(1, q_width + 2 * kv_width)
    q, k, v = qkv[:, :q_width], qkv[:, q_width:q_width + kv_width], qkv[:, q_width + kv_width:]
    cos_sin = torch.randn(4096, HEAD_DIM)
    head = ref.quantize(torch.randn(49152, HIDDEN), ref.Q8_0)
    cases = [
        ("rms_norm 576", 1, "norm", "rms_norm", (torch.empty(1, HIDDEN), x, w, 1e-5)),
        ("fused_add_rms_norm 576", 2 * LAYERS, "norm", "fused_add_rms_norm", (x, res, w, 1e-5)),
        ("rotary neox 9+3 heads", LAYERS, "rotary", "rotary_embedding",
         (torch.tensor([700]), q, k, cos_sin, HEAD_DIM, True)),
        ("silu_and_mul 1536", LAYERS, "activation", "silu_and_mul",
         (torch.empty(1, FFN), torch.randn(1, 2 * FFN) * 4)),
        ("dequantize_rows Q8_0", 1, "quant_gemm", "dequantize_rows",
         (torch.empty(1, HIDDEN), torch.tensor([1234]), head, ref.Q8_0)),
        ("embedding f32", 1, "embedding", "embedding",
         (torch.empty(1, HIDDEN), torch.tensor([1234]), torch.randn(49152, HIDDEN))),
    ]
    for context in (64, 512):
        blocks = context // BLOCK + 1
        kc, vc = torch.randn(blocks * BLOCK, HK, HEAD_DIM), torch.randn(blocks * BLOCK, HK, HEAD_DIM)
        slot = torch.tensor([context - 1])
        tables = torch.randperm(blocks, dtype=torch.int32)[None]
        lens, qsl = torch.tensor([context], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        cases.append((f"store_kv ctx {context}", LAYERS, "kv_cache", "store_kv",
                      (k.view(1, HK, HEAD_DIM), v.view(1, HK, HEAD_DIM), kc, vc, slot)))
        cases.append((f"paged_attention ctx {context}", LAYERS, "attention", "paged_attention",
                      (torch.empty(1, HQ, HEAD_DIM), q.view(1, HQ, HEAD_DIM), kc, vc, tables, lens,
                       qsl, BLOCK, HEAD_DIM ** -0.5, 0)))
    return cases


def bench_ops(reps: int) -> dict[int, float]:
    """Prints us per call and ms per token of each op; returns ms per token by context (the
    context-independent ops count in both)."""
    totals = {64: 0.0, 512: 0.0}
    for label, calls, kernel, function, args in decode_op_cases():
        ffi_args = tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)
        us = per_call_seconds(get_function(kernel, function, "cpu"), ffi_args, reps) * 1e6
        ms = us * calls / 1e3
        print(f"  {label:26s} {us:8.2f} us/call x {calls:3d} = {ms:6.3f} ms/token")
        for context in totals:
            if "ctx" not in label or label.endswith(f"ctx {context}"):
                totals[context] += ms if label != "embedding f32" else 0.0  # the model uses Q8_0
    return totals


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
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--all-isas", action="store_true", help="also time the slower ISAs")
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    torch.manual_seed(0)
    threads = [get_function(k, "set_num_threads", "cpu")(args.threads)
               for k in ("quant_gemm", "attention")][0]
    best = ops.cpu_isa()
    isas = ISAS[: ISAS.index(best) + 1] if args.all_isas else (best,)
    print(f"cpu_isa={best} threads={threads} torch={torch.__version__}")
    op_ms = bench_ops(max(200, args.reps * 20)) if "ops" in sections else {}
    if "matmul" in sections:
        layer_bytes = sum(ref.quantize(torch.zeros(n, k), q).numel() * u for _, k, n, q, u in SHAPES)
        print(f"weights read per decoded token: {layer_bytes / 1e6:.1f} MB")
        for isa in isas:
            for label, t in zip(("median", "best"), bench_matmul(isa, 1, args.reps)):
                print(f"  {isa} decode matmuls ({label}): {t * 1e3:.2f} ms/token, "
                      f"{layer_bytes / t / 1e9:.2f} GB/s -> at most {1 / t:.0f} tok/s")
        layers_s, head_s = token_matmul_seconds(max(5, args.reps // 5))
        mm_ms = (layers_s + head_s) * 1e3
        print(f"  one token's matmuls in model order (best): layers {layers_s * 1e3:.2f} ms "
              f"+ head {head_s * 1e3:.2f} ms = {mm_ms:.2f} ms")
        for context, ms in op_ms.items():
            print(f"  kernels per decode token, ctx {context}: matmuls {mm_ms:.2f} ms "
                  f"+ other ops {ms:.2f} ms = {mm_ms + ms:.2f} ms")
    if "prefill" in sections:
        for label, t in zip(("median", "best"), bench_matmul(best, 64, max(5, args.reps // 5))):
            print(f"  {best} prefill matmuls ({label}): {t / 64 * 1e3:.3f} ms/token "
                  f"-> at most {64 / t:.0f} prompt tok/s")
    if "step" in sections:
        for context in (128, 512):
            med, best_s = decode_step_seconds(context, max(5, args.reps // 5))
            print(f"  decode step, all kernels, context {context}: median {med * 1e3:.2f} ms "
                  f"({1 / med:.0f} tok/s), best {best_s * 1e3:.2f} ms ({1 / best_s:.0f} tok/s)")
    if "attention" in sections:
        for context in (128, 512, 2048):
            for dtype in (torch.float32, torch.float16):
                med, best_s = bench_attention(context, dtype, args.reps)
                print(f"  attention decode ctx={context:<5d} {str(dtype):14s} median "
                      f"{med * 1e6:7.1f} us/layer, best {best_s * 1e6:7.1f} -> "
                      f"{med * LAYERS * 1e3:.2f} ms/token")


if __name__ == "__main__":
    main()
