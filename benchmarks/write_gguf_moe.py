"""Write a Qwen3-MoE GGUF in llama.cpp's Q4_K_M mix directly, one tensor at a time.

    python benchmarks/write_gguf_moe.py OUT.gguf [--shape qwen3-30b-a3b|tiny] [--layers N]
        [--seed 0] [--sigma 0.02] [--threads N]

The full Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts of width 768, 8 per token,
32 q / 4 kv heads of 128, vocabulary 151,936) is ~17 GiB in Q4_K_M; its bf16 folder (~61 GB) would
not fit the benchmark machine's disk, so no float copy is ever made: each tensor's blocks are
drawn at random (benchmarks/kquant_random.py: valid fields, zero-mean values of std `sigma`) and
written before the next one is made. Norms are float32 ones, the router float32 normal values.
Metadata is what llama.cpp's converter writes for `qwen3moe` (hyper-parameters under
``qwen3moe.*``, general.file_type MOSTLY_Q4_K_M) and a placeholder byte-level BPE vocabulary of
the model's size (benchmarks/llama_cpp_cuda/vocab.py); tensors are named, shaped and ordered as
llama-quantize writes them (non-layer tensors first, then layer by layer, by name).

Which type each tensor gets: `q4_k_m_type`, the choice llama-quantize makes for Q4_K_M (read in
vendor/llama.cpp/src/llama-quant.cpp of the llama-cpp-python 0.3.36 sdist).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks import kquant_random as kq  # noqa: E402
from benchmarks.llama_cpp_cuda.vocab import add_placeholder_vocab  # noqa: E402

MOSTLY_Q4_K_M = 15          # llama_ftype / gguf.LlamaFileType
QUANTIZATION_VERSION = 2    # GGML_QNT_VERSION


@dataclass(frozen=True)
class MoEShape:
    """A Qwen3-MoE text model's hyper-parameters (every layer sparse, no shared expert)."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dense_ffn: int = 6144      # config.json's intermediate_size (written, unused by MoE layers)
    context: int = 40960
    rope_theta: float = 1e6
    rms_eps: float = 1e-6


QWEN3_30B_A3B = MoEShape(layers=48, hidden=2048, experts=128, top_k=8, expert_ffn=768,
                         heads=32, kv_heads=4, head_dim=128, vocab=151936)
# For tests on the CPU: expert width 128 is not a multiple of 256, so ffn_down_exps takes
# llama-quantize's fallback types (Q5_0 for Q4_K, Q8_0 for Q6_K).
TINY = MoEShape(layers=2, hidden=256, experts=8, top_k=2, expert_ffn=128, heads=4, kv_heads=2,
                head_dim=64, vocab=512, dense_ffn=512, context=4096)
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's "more bits" layers: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fallback(qtype: int, row: int) -> int:
    """A type whose blocks divide a row of `row` weights: 256-weight K-quants fall back to the
    32-weight type llama-quantize names (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0)."""
    if row % kq.BLOCKS[qtype][0] == 0:
        return qtype
    return {kq.Q4_K: kq.Q5_0, kq.Q5_K: kq.Q5_1, kq.Q6_K: kq.Q8_0}[qtype]


def q4_k_m_type(name: str, ne: tuple[int, ...], layers: int, experts: int,
                tied: bool = False) -> int:
    """The GGML type llama-quantize gives tensor `name` (GGML dims `ne`, row length first) in
    a Q4_K_M file of a `layers`-deep model with `experts` experts per MoE layer.

    The rule, in short: only 2-D and 3-D tensors whose name ends in "weight" are quantized, never
    a norm ("_norm.weight") or a router ("ffn_gate_inp.weight"); those keep their source type
    (F32 here). The LM head (output.weight) is Q6_K, and so is a tied embedding; an untied
    embedding takes the default Q4_K. Layers chosen by `use_more_bits` get Q6_K for attn_v (the
    i-th attn_v counted in file order, which is layer order) and for every ffn_down tensor
    (dense, routed experts, shared expert). Everything else is Q4_K, except in 8-expert models
    (Mixtral), where attn_v and attn_k become Q8_0 and attn_output Q5_K. Last, a 256-weight type
    that does not divide the row length falls back to a 32-weight type (see `_fallback`).
    (llama-quantize also lifts attn_v from Q4_K to Q5_K in 70B-class models; no Qwen3-MoE is
    one.)
    """
    if len(ne) < 2 or not name.endswith("weight") or "_norm.weight" in name \
            or "ffn_gate_inp.weight" in name:
        return kq.F32
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = kq.Q6_K if ne[0] % 256 == 0 else kq.Q8_0
    elif "attn_v.weight" in name or "attn_qkv.weight" in name:
        qtype = kq.Q8_0 if experts == 8 else (
            kq.Q6_K if use_more_bits(layer, layers) else kq.Q4_K)
    elif "attn_k.weight" in name and experts == 8:
        qtype = kq.Q8_0
    elif "attn_output.weight" in name and experts == 8:
        qtype = kq.Q5_K
    elif "ffn_down" in name:
        qtype = kq.Q6_K if use_more_bits(layer, layers) else kq.Q4_K
    else:
        qtype = kq.Q4_K
    return _fallback(qtype, ne[0])


def tensor_table(shape: MoEShape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGML dims with the row length first) of every tensor, in llama-quantize's order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    table = sorted([("token_embd.weight", (h, shape.vocab)), ("output_norm.weight", (h,)),
                    ("output.weight", (h, shape.vocab))])
    for i in range(shape.layers):
        layer = {
            "attn_norm.weight": (h,), "attn_q.weight": (h, q), "attn_k.weight": (h, kv),
            "attn_v.weight": (h, kv), "attn_output.weight": (q, h),
            "attn_q_norm.weight": (shape.head_dim,), "attn_k_norm.weight": (shape.head_dim,),
            "ffn_norm.weight": (h,), "ffn_gate_inp.weight": (h, shape.experts),
            "ffn_gate_exps.weight": (h, shape.expert_ffn, shape.experts),
            "ffn_up_exps.weight": (h, shape.expert_ffn, shape.experts),
            "ffn_down_exps.weight": (shape.expert_ffn, h, shape.experts)}
        table += [(f"blk.{i}.{part}", dims) for part, dims in sorted(layer.items())]
    return table


def _nbytes(qtype: int, ne: tuple[int, ...]) -> int:
    rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
    return 4 * int(np.prod(ne)) if qtype == kq.F32 else rows * kq.row_bytes(qtype, ne[0])


def _metadata(writer, shape: MoEShape, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(MOSTLY_Q4_K_M)
    writer.add_quantization_version(QUANTIZATION_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.dense_ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_expert_feed_forward_length(shape.expert_ffn)
    add_placeholder_vocab(writer, shape.vocab)


def _tensor_data(name: str, ne: tuple[int, ...], qtype: int, sigma: float,
                 seed: np.random.SeedSequence, pool: ThreadPoolExecutor) -> np.ndarray:
    numpy_shape = tuple(reversed(ne))
    if qtype != kq.F32:
        rows = int(np.prod(ne[1:], dtype=np.int64))
        blocks = kq.random_blocks(qtype, rows, ne[0], sigma, seed, pool)
        return blocks.reshape(*numpy_shape[:-1], -1)
    if name.endswith("ffn_gate_inp.weight"):
        return kq.random_f32(numpy_shape, sigma, seed)
    return np.ones(numpy_shape, dtype=np.float32)          # a norm


def write_q4_k_m(path: Path, shape: MoEShape = QWEN3_30B_A3B, seed: int = 0,
                 sigma: float = 0.02, threads: int | None = None,
                 progress=print) -> dict[str, int]:
    """Write the file; returns {GGML type name: tensor count} plus "bytes" (the file size).

    Every tensor's bytes depend on `seed` and its index in the table only."""
    from benchmarks.llama_cpp_cuda.paths import import_gguf

    gguf = import_gguf()
    table = [(name, ne, q4_k_m_type(name, ne, shape.layers, shape.experts))
             for name, ne in tensor_table(shape)]
    free = _free_bytes(path.parent)
    need = sum(_nbytes(q, ne) for _, ne, q in table)
    if free is not None and need > free:
        raise SystemExit(f"{path}: needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free there")
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    _metadata(writer, shape, f"qwen3moe-{shape.layers}L-random-Q4_K_M")
    for name, ne, qtype in table:
        if qtype == kq.F32:
            writer.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32),
                                   _nbytes(qtype, ne))
        else:
            byte_shape = (*reversed(ne[1:]), kq.row_bytes(qtype, ne[0]))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), _nbytes(qtype, ne),
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
            writer.write_tensor_data(_tensor_data(name, ne, qtype, sigma, seq, pool))
            counts[kq.NAMES[qtype]] = counts.get(kq.NAMES[qtype], 0) + 1
            if name.endswith("ffn_up_exps.weight") and progress is not None:
                layer = int(name.split(".")[1])
                progress(f"  layer {layer + 1}/{shape.layers} written "
                         f"({time.perf_counter() - start:.0f} s)")
    writer.close()
    counts["bytes"] = path.stat().st_size
    return counts


def _free_bytes(folder: Path) -> int | None:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def cli(shapes: dict, default: str, write, argv: list[str] | None = None) -> None:
    """The command line of a direct GGUF writer: OUT [--shape NAME] [--layers N] [--seed]
    [--sigma] [--threads]; `write(path, shape, seed, sigma, threads)` writes the file."""
    p = argparse.ArgumentParser(description=sys.modules[write.__module__].__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default=default, choices=sorted(shapes))
    p.add_argument("--layers", type=int, default=None, help="cut the depth (default: the shape's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigma", type=float, default=0.02, help="std of every quantized weight")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    shape = shapes[args.shape]
    if args.layers is not None:
        if not 1 <= args.layers <= shape.layers:
            p.error(f"--layers must be in 1..{shape.layers} for {args.shape}, got {args.layers}")
        shape = replace(shape, layers=args.layers)
    if args.sigma <= 0:
        p.error(f"--sigma must be > 0, got {args.sigma}")
    start = time.perf_counter()
    counts = write(args.out, shape, args.seed, args.sigma, args.threads)
    size = counts.pop("bytes")
    print(f"wrote {args.out}: {size / 2**30:.2f} GiB, {shape.layers} layers, tensors by type "
          f"{counts}, in {time.perf_counter() - start:.0f} s")


def main() -> None:
    cli(SHAPES, "qwen3-30b-a3b", write_q4_k_m)


if __name__ == "__main__":
    main()
