"""Write a Qwen3.6-35B-A3B-shaped hybrid MoE GGUF (llama.cpp's `qwen35moe`) in llama.cpp's
Q4_K_M mix directly, one tensor at a time.

    python benchmarks/write_gguf_hybrid.py OUT.gguf [--shape qwen3.6-35b-a3b|tiny] [--layers N]
        [--seed 0] [--sigma 0.02] [--threads N]

The full shape (benchmarks/gpu_hybrid.py's QWEN36_35B_A3B: 40 layers, hidden 2048, every 4th
layer gated full attention with 16 q / 2 kv heads of 256, the others Gated DeltaNet with 16 key /
32 value heads of 128 and a 4-wide conv; 256 experts of width 512, 8 per token, plus a 512-wide
shared expert; vocabulary 248,320) is ~20 GiB in Q4_K_M (`table_bytes`); its bf16 folder
(~70 GB) would not fit the benchmark machine's disk, so no float copy is made: each tensor's
blocks are drawn at random (benchmarks/kquant_random.py: valid fields, zero-mean values of std
`sigma`) and written before the next one is made, as benchmarks/write_gguf_moe.py does.

Tensors are named and shaped as llama.cpp's loader creates them for qwen35moe
(src/models/qwen35moe.cpp) and as tests/models/hybrid_gguf.py writes them: full-attention layers
attn_q (q and its output gate, 2 x heads x head_dim rows), attn_k, attn_v, attn_output,
attn_q_norm, attn_k_norm; GDN layers attn_qkv, attn_gate, ssm_conv1d [K, conv], ssm_dt.bias,
ssm_a, ssm_alpha, ssm_beta, ssm_norm, ssm_out; every layer attn_norm, post_attention_norm, the
router, the stacked experts and the shared expert (ffn_*_shexp, its gate ffn_gate_inp_shexp
[hidden, 1]). Order: non-layer tensors first, then layer by layer, by name (as write_gguf_moe).
No multi-token-prediction block is written (block_count = the trunk's layers).

Values: quantized weights random of std `sigma`; RMSNorm weights (which the file stores as
1 + w, ssm_norm as w) float32 ones; the routers (ffn_gate_inp, ffn_gate_inp_shexp) float32
normal of std `sigma`; ssm_conv1d float32 normal of std 1/sqrt(K) (a mixing filter of unit
gain, as PyTorch's default conv init roughly gives); ssm_dt.bias ones (HF's init); ssm_a =
-A with A uniform in [1, 16) (HF draws A uniform in (0, 16); the file holds -exp(A_log) = -A,
which FreeToken's reader takes the log of, so it must be negative).

Metadata: what llama.cpp's converter writes for qwen35moe and FreeToken's reader needs (as
tests/models/hybrid_gguf.py: qwen35moe.* hyper-parameters, ssm.* keys, attention.recurrent_layers
and full_attention_interval, rope.dimension_sections, rope.dimension_count = head_dim / 4),
general.file_type MOSTLY_Q4_K_M and the placeholder byte-level BPE vocabulary
(benchmarks/llama_cpp_cuda/vocab.py).

Which type each tensor gets: `q4_k_m_type`, read in vendor/llama.cpp/src/llama-quant.cpp of the
llama-cpp-python 0.3.36 sdist (see its docstring).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks import kquant_random as kq  # noqa: E402
from benchmarks import write_gguf_moe as moe  # noqa: E402
from benchmarks.llama_cpp_cuda.vocab import add_placeholder_vocab  # noqa: E402

ARCH = "qwen35moe"


@dataclass(frozen=True)
class HybridShape:
    """A Qwen3.5/3.6-MoE text model's hyper-parameters (every layer sparse with a shared
    expert; every `full_attention_interval`-th layer full attention, the others GDN)."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int
    heads: int                 # full attention
    kv_heads: int
    head_dim: int
    linear_k_heads: int        # Gated DeltaNet
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    vocab: int
    full_attention_interval: int = 4
    context: int = 262144
    rope_theta: float = 1e7
    partial_rotary: float = 0.25
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)
    rms_eps: float = 1e-6

    def is_full_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0


# gpu_hybrid.QWEN36_35B_A3B (Qwen3_5MoeTextConfig's defaults); rope theta 1e7 and context 262144
# are the released Qwen3.6-35B-A3B config.json's (gpu_hybrid leaves them at transformers'
# defaults; neither changes a byte of tensor data)
QWEN36_35B_A3B = HybridShape(
    layers=40, hidden=2048, experts=256, top_k=8, expert_ffn=512, shared_ffn=512, heads=16,
    kv_heads=2, head_dim=256, linear_k_heads=16, linear_v_heads=32, linear_k_dim=128,
    linear_v_dim=128, conv_kernel=4, vocab=248320)
# For tests on the CPU: 3 GDN layers + 1 full attention; 16 experts (not 8, which would take
# llama-quantize's Mixtral rule); expert and shared widths 128 make ffn_down_exps / _shexp take
# the 32-weight fallback types. llama.cpp needs head_v_dim = head_k_dim (ssm.state_size).
TINY = HybridShape(
    layers=4, hidden=256, experts=16, top_k=2, expert_ffn=128, shared_ffn=128, heads=4,
    kv_heads=2, head_dim=64, linear_k_heads=2, linear_v_heads=4, linear_k_dim=64,
    linear_v_dim=64, conv_kernel=4, vocab=512, context=4096, rope_sections=(3, 3, 2, 0))
SHAPES = {"qwen3.6-35b-a3b": QWEN36_35B_A3B, "tiny": TINY}


def _n_dims(ne: tuple[int, ...]) -> int:
    """ggml_n_dims: trailing dimensions of 1 do not count (ffn_gate_inp_shexp [n, 1] is 1-D)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def q4_k_m_type(name: str, ne: tuple[int, ...], layers: int, experts: int) -> int:
    """The GGML type llama-quantize gives tensor `name` (GGML dims `ne`, row length first) in a
    Q4_K_M file of a `layers`-deep qwen35moe model with `experts` experts per layer.

    Read in llama-quant.cpp (llama-cpp-python 0.3.36): `tensor_allows_quantization` keeps the
    source type (F32 here) for tensors of fewer than 2 ggml dims (trailing 1s do not count:
    ssm_a, ssm_dt.bias, the norms, ffn_gate_inp_shexp [hidden, 1]), names not ending in
    "weight", "_norm.weight" (ssm_norm included), "ffn_gate_inp.weight" and "ssm_conv1d". The
    rest goes through write_gguf_moe's rule: its tensor categories see attn_qkv as
    attention-v-like (`category_is_attn_v`), and that branch precedes the separate
    ATTENTION_QKV branch (Q5_K for Q4_K_M), which is therefore never reached outside the IQ2
    mixes: attn_v and attn_qkv get Q6_K where use_more_bits(i, n), i counting the attn_v /
    attn_qkv tensors seen so far and n all of them; each layer has exactly one, so i is the
    layer and n the depth. ffn_down (routed and shared) gets Q6_K on use_more_bits(layer,
    n_layer_all); the GDN projections (attn_gate, ssm_alpha, ssm_beta, ssm_out) fall in the
    OTHER category and take the default Q4_K, as do attn_q, attn_k, attn_output, the gate and
    up projections and the (untied) embedding; output.weight is Q6_K. The model type is
    35B_A3B, so the 70B attn_v lift does not apply. 256-weight types fall back to 32-weight
    ones where rows are not a multiple of 256.
    """
    if _n_dims(ne) < 2 or "ssm_conv1d" in name:
        return kq.F32
    return moe.q4_k_m_type(name, ne, layers, experts)


def layer_tensors(shape: HybridShape, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s tensors (name after "blk.{i}.") -> GGML dims, row length first."""
    h, e = shape.hidden, shape.experts
    parts = {
        "attn_norm.weight": (h,), "post_attention_norm.weight": (h,),
        "ffn_gate_inp.weight": (h, e),
        "ffn_gate_exps.weight": (h, shape.expert_ffn, e),
        "ffn_up_exps.weight": (h, shape.expert_ffn, e),
        "ffn_down_exps.weight": (shape.expert_ffn, h, e),
        "ffn_gate_inp_shexp.weight": (h, 1),
        "ffn_gate_shexp.weight": (h, shape.shared_ffn),
        "ffn_up_shexp.weight": (h, shape.shared_ffn),
        "ffn_down_shexp.weight": (shape.shared_ffn, h),
    }
    if shape.is_full_attention(layer):
        q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
        parts.update({
            "attn_q.weight": (h, 2 * q), "attn_k.weight": (h, kv), "attn_v.weight": (h, kv),
            "attn_output.weight": (q, h), "attn_q_norm.weight": (shape.head_dim,),
            "attn_k_norm.weight": (shape.head_dim,)})
    else:
        key = shape.linear_k_heads * shape.linear_k_dim
        value = shape.linear_v_heads * shape.linear_v_dim
        hv = shape.linear_v_heads
        parts.update({
            "attn_qkv.weight": (h, 2 * key + value), "attn_gate.weight": (h, value),
            "ssm_conv1d.weight": (shape.conv_kernel, 2 * key + value),
            "ssm_dt.bias": (hv,), "ssm_a": (hv,), "ssm_alpha.weight": (h, hv),
            "ssm_beta.weight": (h, hv), "ssm_norm.weight": (shape.linear_v_dim,),
            "ssm_out.weight": (value, h)})
    return parts


def tensor_table(shape: HybridShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGML dims with the row length first) of every tensor, in file order."""
    h = shape.hidden
    table = sorted([("token_embd.weight", (h, shape.vocab)), ("output_norm.weight", (h,)),
                    ("output.weight", (h, shape.vocab))])
    for i in range(shape.layers):
        table += [(f"blk.{i}.{part}", dims)
                  for part, dims in sorted(layer_tensors(shape, i).items())]
    return table


def typed_table(shape: HybridShape) -> list[tuple[str, tuple[int, ...], int]]:
    return [(name, ne, q4_k_m_type(name, ne, shape.layers, shape.experts))
            for name, ne in tensor_table(shape)]


def table_bytes(shape: HybridShape) -> int:
    """Bytes of all tensor data of the Q4_K_M file (without header, metadata and padding)."""
    return sum(moe._nbytes(qtype, ne) for _, ne, qtype in typed_table(shape))


def _metadata(writer, shape: HybridShape, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(moe.MOSTLY_Q4_K_M)
    writer.add_quantization_version(moe.QUANTIZATION_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    writer.add_expert_shared_feed_forward_length(shape.shared_ffn)
    writer.add_ssm_conv_kernel(shape.conv_kernel)
    writer.add_ssm_state_size(shape.linear_k_dim)
    writer.add_ssm_group_count(shape.linear_k_heads)
    writer.add_ssm_time_step_rank(shape.linear_v_heads)
    writer.add_ssm_inner_size(shape.linear_v_dim * shape.linear_v_heads)
    writer.add_array(f"{ARCH}.attention.recurrent_layers",
                     [not shape.is_full_attention(i) for i in range(shape.layers)])
    writer.add_array(f"{ARCH}.rope.dimension_sections", list(shape.rope_sections))
    writer.add_uint32(f"{ARCH}.full_attention_interval", shape.full_attention_interval)
    writer.add_rope_dimension_count(int(shape.head_dim * shape.partial_rotary))
    add_placeholder_vocab(writer, shape.vocab)


def _f32_data(name: str, numpy_shape: tuple[int, ...], shape: HybridShape, sigma: float,
              seed: np.random.SeedSequence) -> np.ndarray:
    if name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return kq.random_f32(numpy_shape, sigma, seed)
    if name.endswith("ssm_conv1d.weight"):
        return kq.random_f32(numpy_shape, 1.0 / np.sqrt(shape.conv_kernel), seed).astype(np.float32)
    if name.endswith(".ssm_a"):
        rng = np.random.default_rng(seed)
        return -rng.uniform(1.0, 16.0, numpy_shape).astype(np.float32)
    return np.ones(numpy_shape, dtype=np.float32)        # norms, ssm_dt.bias


def _tensor_data(name: str, ne: tuple[int, ...], qtype: int, shape: HybridShape, sigma: float,
                 seed: np.random.SeedSequence, pool: ThreadPoolExecutor) -> np.ndarray:
    numpy_shape = tuple(reversed(ne))
    if qtype == kq.F32:
        return _f32_data(name, numpy_shape, shape, sigma, seed)
    rows = int(np.prod(ne[1:], dtype=np.int64))
    blocks = kq.random_blocks(qtype, rows, ne[0], sigma, seed, pool)
    return blocks.reshape(*numpy_shape[:-1], -1)


def write_q4_k_m(path: Path, shape: HybridShape = QWEN36_35B_A3B, seed: int = 0,
                 sigma: float = 0.02, threads: int | None = None,
                 progress=print) -> dict[str, int]:
    """Write the file; returns {GGML type name: tensor count} plus "bytes" (the file size).

    Every tensor's bytes depend on `seed` and its index in the table only."""
    from benchmarks.llama_cpp_cuda.paths import import_gguf

    gguf = import_gguf()
    path = Path(path)
    table = typed_table(shape)
    free = moe._free_bytes(path.parent)
    need = sum(moe._nbytes(q, ne) for _, ne, q in table)
    if free is not None and need > free:
        raise SystemExit(f"{path}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free there")
    writer = gguf.GGUFWriter(str(path), ARCH)
    _metadata(writer, shape, f"{ARCH}-{shape.layers}L-random-Q4_K_M")
    for name, ne, qtype in table:
        if qtype == kq.F32:
            writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32),
                                   moe._nbytes(qtype, ne))
        else:
            byte_shape = (*reversed(ne[1:]), kq.row_bytes(qtype, ne[0]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), moe._nbytes(qtype, ne),
                                   raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.open_output_file()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    counts: dict[str, int] = {}
    start = time.perf_counter()
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
        for index, (name, ne, qtype) in enumerate(table):
            seq = np.random.SeedSequence(seed, spawn_key=(index,))
            writer.write_tensor_data(_tensor_data(name, ne, qtype, shape, sigma, seq, pool))
            counts[kq.NAMES[qtype]] = counts.get(kq.NAMES[qtype], 0) + 1
            if name.endswith("ffn_up_exps.weight") and progress is not None:
                layer = int(name.split(".")[1])
                progress(f"  layer {layer + 1}/{shape.layers} written "
                         f"({time.perf_counter() - start:.0f} s)")
    writer.close()
    counts["bytes"] = path.stat().st_size
    return counts


def main() -> None:
    moe.cli(SHAPES, "qwen3.6-35b-a3b", write_q4_k_m)


if __name__ == "__main__":
    main()
