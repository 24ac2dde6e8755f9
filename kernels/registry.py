"""The kernel registry: the single source of truth for every compiled kernel.

The cache-wheel build and the runtime loader both derive names, keys and targets from ``KERNELS``.
Stdlib only: the build backend loads this file by path, without importing freetoken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Target name -> (backend, compiler arch flag). One `.so` per (kernel, variant, target).
CPU_TARGETS = ("cpu-x86_64",)
CUDA_TARGETS = ("sm_86", "sm_89", "sm_90a", "sm_100f", "sm_120", "compute_120")
ROCM_TARGETS = ("gfx1151", "gfx1201")
ALL_TARGETS = CPU_TARGETS + CUDA_TARGETS + ROCM_TARGETS


def backend_of(target: str) -> str:
    """'cpu', 'cuda' or 'rocm' for a target (cache targets, or any sm_XY / gfxNNNN for JIT)."""
    if target in CPU_TARGETS:
        return "cpu"
    if target in CUDA_TARGETS or re.fullmatch(r"(sm|compute)_\d+[af]?", target):
        return "cuda"
    if target in ROCM_TARGETS or re.fullmatch(r"gfx[0-9a-f]+", target):
        return "rocm"
    raise ValueError(f"unknown kernel target {target!r}; known: {', '.join(ALL_TARGETS)}")


@dataclass(frozen=True)
class Variant:
    """A compile-time instantiation: its name joins the artifact name, its defines the flags."""

    name: str = "default"
    defines: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Kernel:
    """One kernel library: sources per backend (paths relative to kernels/), exported functions."""

    name: str
    functions: tuple[str, ...]
    cpu: tuple[str, ...] = ()
    cuda: tuple[str, ...] = ()  # ROCm builds the same sources through the hip/ shim headers
    rocm: bool = False
    cpu_functions: tuple[str, ...] = ()  # exported by the CPU build only
    variants: tuple[Variant, ...] = (Variant(),)
    doc: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def functions_for(self, backend: str) -> tuple[str, ...]:
        return self.functions + (self.cpu_functions if backend == "cpu" else ())

    def sources_for(self, backend: str) -> tuple[str, ...]:
        if backend == "cpu":
            return self.cpu
        if backend == "cuda":
            return self.cuda
        if backend == "rocm":
            return self.cuda if self.rocm else ()
        raise ValueError(f"unknown backend {backend!r}")

    def targets(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.cpu:
            out += CPU_TARGETS
        if self.cuda:
            out += CUDA_TARGETS
        if self.cuda and self.rocm:
            out += ROCM_TARGETS
        return tuple(out)


KERNELS: tuple[Kernel, ...] = (
    Kernel(
        name="norm",
        functions=("rms_norm", "fused_add_rms_norm", "rms_norm_gated"),
        cpu=("cpu/norm.cc",),
        cuda=("cuda/norm.cu",),
        rocm=True,
        doc="RMSNorm: plain, fused with the residual add, and gated by silu(z) per head group",
    ),
    Kernel(
        name="rotary",
        functions=("rotary_embedding",),
        cpu=("cpu/rotary.cc",),
        cuda=("cuda/rotary.cu",),
        rocm=True,
        doc="rotary position embedding, neox and interleaved layouts, in place",
    ),
    Kernel(
        name="activation",
        functions=("silu_and_mul", "gelu_tanh_and_mul"),
        cpu=("cpu/activation.cc",),
        cuda=("cuda/activation.cu",),
        rocm=True,
        doc="SiLU(gate) * up or GELU-tanh(gate) * up over a [.., 2*d] input",
    ),
    Kernel(
        name="kv_cache",
        functions=("store_kv", "store_kv_fp8"),
        cpu=("cpu/kv_cache.cc",),
        cuda=("cuda/kv_cache.cu",),
        rocm=True,
        doc="store K and V rows into the paged pool by slot index; store_kv_fp8 quantizes them "
            "into the FP8 pool (e4m3 codes and a float32 scale per slot and KV head)",
    ),
    Kernel(
        name="embedding",
        functions=("embedding",),
        cpu=("cpu/embedding.cc",),
        cuda=("cuda/embedding.cu",),
        rocm=True,
        doc="gather embedding rows by token id",
    ),
    Kernel(
        name="attention",
        functions=("paged_attention", "paged_attention_fp8"),
        cpu_functions=("set_num_threads",),
        cpu=("cpu/attention.cc",),
        cuda=("cuda/attention.cu",),
        rocm=True,  # HIP: the CUDA-core kernel serves every batch (no tensor-core path)
        doc="causal attention over the paged KV pool (prefill chunks and decode), of the "
            "model's dtype or FP8 (paged_attention_fp8)",
    ),
    Kernel(
        name="quant_gemm",
        functions=("quant_matmul", "quant_matmul_isa", "quant_pack", "quant_matmul_packed",
                   "dequantize_rows", "cpu_isa", "set_num_threads"),
        cpu=("cpu/quant_gemm.cc",),
        doc="GGUF block matrix product with runtime ISA dispatch; GGUF rows packed 16 wide for "
            "AVX-512 VNNI",
    ),
    Kernel(
        name="float_gemm",
        functions=("float_matmul",),
        cpu=("cpu/float_gemm.cc",),
        doc="small f32 x f32/f16/bf16 products (decode) on the kernels' thread pool",
    ),
    Kernel(
        name="sampling",
        functions=("sample_tokens",),
        cuda=("cuda/sampling.cu",),
        rocm=True,
        doc="temperature / top-k / top-p sampling on the GPU",
    ),
    Kernel(
        name="moe",
        functions=("moe_topk_softmax", "moe_experts"),
        cpu_functions=("moe_experts_quant", "moe_experts_quant_isa", "moe_experts_quant_packed"),
        cpu=("cpu/moe.cc",),
        cuda=("cuda/moe.cu",),
        rocm=True,
        doc="MoE routing (softmax top-k) and routed expert MLPs (SwiGLU)",
    ),
    Kernel(
        name="gguf_gemm",
        functions=("gguf_matmul", "gguf_dequantize_rows", "gguf_dequantize"),
        cuda=("cuda/gguf_gemm.cu",),
        rocm=True,  # HIP: a CUDA-core tile replaces the wmma tensor-core tile of prefill
        doc="GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks in VRAM: decode GEMV, prefill "
            "GEMM, row gather, and whole weights dequantized to bf16 for prefill's float GEMMs",
    ),
    Kernel(
        name="gdn",
        functions=("gdn_conv1d", "gdn_recurrence"),
        cpu=("cpu/gdn.cc",),
        cuda=("cuda/gdn.cu",),
        rocm=True,
        doc="Gated DeltaNet: short causal conv1d and the gated delta-rule recurrence over "
            "per-sequence state slots (prefill chunks and decode)",
    ),
    Kernel(
        name="decode_gemv",
        functions=("decode_gemv", "decode_gemv_add", "decode_gemv_swiglu"),
        cuda=("cuda/decode_gemv.cu",),
        rocm=True,
        doc="small-batch (T <= 8) decode projections: RMSNorm prologue, bias / residual-add / "
            "SwiGLU epilogues",
    ),
    Kernel(
        name="rope_kv",
        functions=("rope_store_kv", "rope_store_kv_fp8"),
        cuda=("cuda/rope_kv.cu",),
        rocm=True,
        doc="per-head q/k RMSNorm + rotary embedding + paged KV store in one launch, into "
            "a pool of the model's dtype or the FP8 pool (rope_store_kv_fp8)",
    ),
    Kernel(
        name="scaled_gemm",
        functions=("scaled_gemv", "scaled_dequantize"),
        cpu=("cpu/scaled_gemm.cc",),
        cuda=("cuda/scaled_gemm.cu",),
        rocm=True,
        doc="FP8 (block, channel, tensor scales) and NVFP4 weights: dequantizing GEMV for "
            "decode, dequantize-to-float for the prefill GEMM (the CPU: FP8 only, any batch)",
    ),
    Kernel(
        name="moe_scaled",
        functions=("moe_experts_scaled",),
        cpu=("cpu/moe_scaled.cc",),
        cuda=("cuda/moe_scaled.cu",),
        rocm=True,
        doc="routed SwiGLU experts over FP8/NVFP4 expert weights for decode batches (the "
            "CPU: FP8 only, any batch)",
    ),
    Kernel(
        name="moe_gguf",
        functions=("moe_experts_gguf",),
        cuda=("cuda/moe_gguf.cu",),
        rocm=True,  # HIP: a CUDA-core tile replaces the wmma tensor-core tile of prefill
        doc="routed expert MLPs (SwiGLU) over GGUF blocks in VRAM, gate/up and down types "
            "independent",
    ),
    Kernel(
        name="vision_attention",
        functions=("vision_attention",),
        cpu=("cpu/vision_attention.cc",),
        cuda=("cuda/vision_attention.cu",),
        rocm=True,
        doc="non-causal attention within variable-length segments (cu_seqlens): the vision "
            "encoder's patches attend within their own image; head_dim a multiple of 8 <= 128",
    ),
    Kernel(
        name="quant_gemv",
        functions=("gguf_gemv",),
        cuda=("cuda/quant_gemv.cu",),
        rocm=True,
        doc="decode GEMV (T <= 8) streaming GGUF Q4_0/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K rows in 16-byte "
            "coalesced loads, several rows per warp (FREETOKEN_QUANT_GEMV=v2)",
    ),
    Kernel(
        name="gguf_gemv_q8",
        functions=("gguf_gemv_q8", "moe_q8_gate_up", "moe_q8_down"),
        cuda=("cuda/gguf_gemv_q8.cu",),
        rocm=True,
        doc="decode GEMV (T <= 2) over GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K rows on int8 "
            "activations quantized in its prologue (optionally RMS-normed), dp4a sums; store "
            "(+ bias), residual-add and SwiGLU epilogues; and the MoE decode step over GGUF "
            "experts as the same kernels on gathered rows (gate/up + SwiGLU per routed pair, "
            "down + weighted combine [+ residual add] per token)",
    ),
    Kernel(
        name="fp8_gemv",
        functions=("fp8_gemv", "fp8_gemv_fused"),
        cuda=("cuda/fp8_gemv.cu",),
        rocm=True,
        doc="decode GEMV (T <= 8) streaming FP8 weights (block, channel, tensor scales) in "
            "16-byte coalesced loads, several rows per warp (FREETOKEN_QUANT_GEMV=v2); "
            "fp8_gemv_fused adds the RMSNorm prologue and the bias, residual-add and SwiGLU "
            "epilogues of the fused decode step (v3)",
    ),
    Kernel(
        name="moe_decode",
        functions=("moe_decode_gate_up", "moe_decode_down"),
        cuda=("cuda/moe_decode.cu",),
        rocm=True,
        doc="small-batch (T <= 8) MoE decode over bf16/f16 experts: gate/up + SwiGLU per routed "
            "expert (each read once), down + weighted combine + shared expert + residual add",
    ),
)

KERNELS_BY_NAME = {k.name: k for k in KERNELS}
