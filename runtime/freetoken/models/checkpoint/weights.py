"""Checkpoint-neutral decoder weights: readers name tensors canonically (see registry.py),
this module checks shapes against the config, places them on the device and concatenates q/k/v
and gate/up rows once; routed experts are stacked [E, 2I, H] and [E, H, I].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays, is_torch
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.errors import MissingTensorError, ModelFormatError, UnsupportedModelError
from freetoken.models.quant import scaled
from freetoken.models.quant.scaled import ScaledWeight

Array = Any  # a numpy array (CPU, and as read from GGUF) or a torch tensor
Weight = Union[Array, QuantWeight, ScaledWeight]


class TensorSource(Protocol):
    """What a checkpoint reader offers: tensors by canonical name, and their file names."""

    source: str

    def get(self, name: str) -> Weight | None:
        """The tensor (rows = output features), or None when the checkpoint lacks it."""

    def file_name(self, name: str) -> str:
        """How the checkpoint spells a canonical name (for error messages)."""


# GGML block types the quantized kernels read: the CPU's quant_gemm, the GPU's gguf_gemm.
# GGML type ids: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14
CPU_BLOCK_TYPES = (2, 3, 6, 7, 8, 12, 13, 14)
GPU_BLOCK_TYPES = CPU_BLOCK_TYPES


@dataclass(frozen=True)
class Placement:
    """Where weights live and in which float dtype. GGUF blocks stay quantized where a kernel
    reads them (the GPU kernels take bf16 activations: other GPU dtypes dequantize at load),
    routed experts included."""

    arrays: HostArrays | TorchArrays
    dtype: str                     # float32 | bfloat16 | float16
    # Where routed experts go when not beside the rest (expert offload: host torch tensors).
    experts: Any = None

    @property
    def expert_arrays(self) -> HostArrays | TorchArrays:
        return self.experts if self.experts is not None else self.arrays

    @property
    def torch_device(self):
        """The torch device of this placement's tensors ("cpu" for host arrays)."""
        return _torch_device(self.arrays)

    @property
    def experts_torch_device(self):
        """The torch device of the routed experts' tensors (host memory when offloaded)."""
        return _torch_device(self.expert_arrays)

    def keeps_scaled(self, fmt: str, kernel_ready: bool) -> bool:
        """Whether a scaled matrix of format `fmt` stays in its format here: on a GPU where its
        kernels take the layout; on the CPU, FP8 in a float32 model (the CPU kernels take
        float32 activations: scaled_gemm.cc, moe_scaled.cc), NVFP4 never."""
        if not kernel_ready:
            return False
        if self.arrays.device.is_cpu:
            return fmt == scaled.FP8 and self.dtype == "float32"
        return True

    def keeps_experts(self, qtype: int) -> bool:
        """Whether stacked experts of GGML type `qtype` stay in their blocks here (read by the
        CPU's moe_experts_quant, or on a GPU by moe_experts_gguf and the decode kernels of
        moe_decode_quant.py). Offloaded experts keep them too, in host memory: the expert
        cache moves blocks (engine/expert_pool.py)."""
        return self.keeps(qtype)

    def keeps(self, qtype: int) -> bool:
        """Whether a matrix of GGML type `qtype` stays in its blocks here."""
        if self.arrays.device.is_cpu:
            return qtype in CPU_BLOCK_TYPES
        return self.dtype == "bfloat16" and qtype in GPU_BLOCK_TYPES

    def can_serve(self, qtype: int) -> bool:
        """False for block types the CPU kernels cannot read (the GPU dequantizes the rest)."""
        return not self.arrays.device.is_cpu or qtype in CPU_BLOCK_TYPES


def _torch_device(arrays) -> Any:
    return getattr(arrays, "torch_device", "cpu")


# A layer's weights by canonical part (registry.LAYER_PARTS), with fused entries: "qkv" (one
# matrix or its parts) and "qkv_bias"; "gate_up" (dense MLP); "experts.gate_up" [E, 2I, H] and
# "experts.down" [E, H, I]; "shared.gate_up" and "shared.down" for a shared expert.
LayerWeights = dict[str, Any]


@dataclass
class DecoderWeights:
    embed: Weight
    layers: list[LayerWeights]
    final_norm: Array
    lm_head: Weight
    rope_freq_factors: Array | None = None


def dequantize(weight: QuantWeight) -> np.ndarray:
    """float32 [rows, cols] values of GGUF blocks."""
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(np.asarray(weight.data), GGMLQuantizationType(weight.qtype))
    return values.reshape(weight.shape)


def gpu_rows(data: np.ndarray) -> np.ndarray:
    """GGUF rows as the GPU kernels read them: each row's blocks padded with zeros to whole
    16-byte words (Q6_K rows of 3 blocks are 630 bytes), so every row starts aligned for the
    kernels' 16-byte loads. The blocks themselves are the file's."""
    pad = -data.shape[-1] % 16
    if not pad:
        return data
    return np.pad(data, [(0, 0)] * (data.ndim - 1) + [(0, pad)])


def _shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def _place_experts(weight: QuantWeight, where: Placement) -> QuantWeight:
    """Stacked GGUF experts: beside the rest, or in host memory when offloaded (the GPU's row
    layout either way, so the expert cache copies rows as the kernels read them)."""
    if where.experts is None or where.arrays.device.is_cpu:
        return _place(weight, where)
    return QuantWeight(weight.qtype, where.experts.place(gpu_rows(weight.data), "uint8"),
                       weight.shape)


def _place(weight: Weight, where: Placement) -> Weight:
    if isinstance(weight, ScaledWeight):
        # the bytes and their scales where a kernel reads them (Placement.keeps_scaled), else
        # dequantized once
        if not where.keeps_scaled(weight.format, scaled.kernel_ready(weight)):
            return where.arrays.place(scaled.dequantize(weight), where.dtype)
        return scaled.to_device(weight, where.torch_device)
    if isinstance(weight, QuantWeight):
        if where.keeps(weight.qtype):
            if where.arrays.device.is_cpu:
                return weight
            return QuantWeight(weight.qtype, where.arrays.place(gpu_rows(weight.data), "uint8"),
                               weight.shape)
        weight = dequantize(weight)
    return where.arrays.place(weight, where.dtype)


def _fuse_rows(parts: list[Weight]) -> list[Weight]:
    """One matrix when the parts concatenate (same float dtype, or same GGUF block type, or
    scaled weights whose scales line up). Mixed GGUF types (the _M mixes: Gemma 3's q and k
    Q5_0, v Q8_0) join each run of adjacent parts of one type, so q and k are one product."""
    if all(isinstance(p, ScaledWeight) for p in parts):
        joined = scaled.concat_rows(parts)
        return parts if joined is None else [joined]
    if not any(isinstance(p, (QuantWeight, ScaledWeight)) for p in parts):
        return [_concat(parts)]
    if all(isinstance(p, QuantWeight) for p in parts):
        return [_join_quant(run) for run in _quant_runs(parts)]
    return parts


def _quant_runs(parts: list[QuantWeight]) -> list[list[QuantWeight]]:
    """Adjacent GGUF parts grouped while block type and row width stay the same."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        last = runs[-1][-1]
        if part.qtype == last.qtype and part.data.shape[1] == last.data.shape[1]:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _join_quant(run: list[QuantWeight]) -> QuantWeight:
    if len(run) == 1:
        return run[0]
    rows = sum(p.shape[0] for p in run)
    return QuantWeight(run[0].qtype, _concat([p.data for p in run]), (rows, run[0].shape[1]))


def _concat(parts: list[Array], axis: int = 0) -> Array:
    """Concatenation of placed float arrays (all numpy, or all torch on one device)."""
    if is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=axis)
    return np.concatenate(parts, axis=axis)


class _Reader:
    """Fetches, checks the shape of and places each tensor."""

    def __init__(self, src: TensorSource, where: Placement, architecture: str):
        self.src, self.where, self.where_config = src, where, architecture

    def optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        weight = self.src.get(name)
        if weight is None:
            return None
        return self.check(name, weight, shape)

    def check(self, name: str, weight: Weight | None, shape: tuple[int, ...]) -> Weight:
        """`weight` (required) checked against `shape` and placed."""
        if weight is None:
            raise MissingTensorError(
                f"{self.src.source}: missing tensor {self.src.file_name(name)!r}; the "
                f"checkpoint is incomplete or does not match its {self.where_config} config")
        self.servable(name, weight)
        if _shape(weight) != shape:
            raise ModelFormatError(
                f"{self.src.source}: tensor {self.src.file_name(name)!r} has shape "
                f"{list(_shape(weight))}, expected {list(shape)} from the model config")
        return _place(weight, self.where)

    def servable(self, name: str, weight: Weight) -> None:
        """Refuses, by tensor and type, GGUF blocks that no kernel here reads."""
        if isinstance(weight, QuantWeight) and not self.where.can_serve(weight.qtype):
            from gguf import GGMLQuantizationType

            kind = GGMLQuantizationType(weight.qtype).name
            raise UnsupportedModelError(
                f"{self.src.source}: tensor {self.src.file_name(name)!r} has type {kind}, which "
                f"the CPU kernels do not read; serve it on a GPU "
                f"(--device cuda) or re-quantize the model")

    def fused(self, parts: list[tuple[str, tuple[int, ...]]]) -> list[Weight]:
        """Required tensors whose rows are concatenated into one matrix when they can be.

        A source with ``release(name)`` may then drop the originals from memory (the GGUF
        reader unmaps their pages), so the file's copies do not count twice in the RSS."""
        weights = [self.required(name, shape) for name, shape in parts]
        fused = _fuse_rows(weights)
        release = getattr(self.src, "release", None)
        if release is not None:
            kept = {id(w) for w in fused}   # parts that were not copied into a joined matrix
            for (name, _), weight in zip(parts, weights):
                if id(weight) not in kept:
                    release(name)
        return fused

    def required(self, name: str, shape: tuple[int, ...]) -> Weight:
        return self.check(name, self.src.get(name), shape)

    def stacked(self, parts: list[tuple[str, tuple[int, ...]]]) -> Weight:
        """Stacked expert tensors [E, rows, cols] joined along the rows of each expert: GGUF
        blocks stay quantized when every part has one block type, else all become floats."""
        raw = [self.src.get(name) for name, _ in parts]
        for (name, shape), weight in zip(parts, raw):
            if weight is None or _shape(weight) != shape:
                self.check(name, weight, shape)      # raises, naming the tensor
            self.servable(name, weight)
        if all(isinstance(w, ScaledWeight) and w.format == raw[0].format and
               self.where.keeps_scaled(w.format, scaled.kernel_ready(w)) for w in raw):
            # FP8/NVFP4 experts stay in their format where their scales line up: on a GPU,
            # offloaded in host memory (the expert cache copies their bytes:
            # engine/expert_pool.ScaledPool), or FP8 on the CPU
            device = self.where.experts_torch_device
            joined = scaled.concat_rows([scaled.to_device(w, device) for w in raw])
            if joined is not None:
                return joined
        quant = [isinstance(w, QuantWeight) for w in raw]
        if all(quant) and len({w.qtype for w in raw}) == 1 and self.where.keeps_experts(
                raw[0].qtype):
            if len(raw) == 1:
                return _place_experts(raw[0], self.where)
            rows = sum(w.shape[1] for w in raw)
            joined = _place_experts(QuantWeight(raw[0].qtype,
                                                np.concatenate([w.data for w in raw], axis=1),
                                                (raw[0].shape[0], rows, raw[0].shape[2])),
                                    self.where)
        else:
            floats = [dequantize(w) if isinstance(w, QuantWeight) else
                      scaled.dequantize(w) if isinstance(w, ScaledWeight) else w for w in raw]
            placed = [self.where.expert_arrays.place(w, self.where.dtype) for w in floats]
            joined = placed[0] if len(placed) == 1 else _concat(placed, axis=1)
        release = getattr(self.src, "release", None)
        if release is not None and len(parts) > 1:   # joined into a copy: drop the file's pages
            for name, _ in parts:
                release(name)
        return joined


def _attention(read: _Reader, cfg: ModelConfig, p: str) -> LayerWeights:
    h, qs, kvs = cfg.hidden_size, cfg.q_size, cfg.kv_size
    w = {"input_norm": read.required(p + "input_norm", (h,)),
         "qkv": read.fused([(p + "q", (qs, h)), (p + "k", (kvs, h)), (p + "v", (kvs, h))]),
         "o": read.required(p + "o", (h, qs)),
         "post_norm": read.required(p + "post_norm", (h,))}
    if cfg.block_out_norms:
        w["attn_out_norm"] = read.required(p + "attn_out_norm", (h,))
        w["mlp_out_norm"] = read.required(p + "mlp_out_norm", (h,))
    if cfg.attention_bias:
        w["qkv_bias"] = _concat([read.required(p + "q_bias", (qs,)),
                                 read.required(p + "k_bias", (kvs,)),
                                 read.required(p + "v_bias", (kvs,))])
    norm_sizes = {"head": (cfg.head_dim, cfg.head_dim), "full": (qs, kvs)}
    if cfg.qk_norm:
        q_size, k_size = norm_sizes[cfg.qk_norm]
        w["q_norm"] = read.required(p + "q_norm", (q_size,))
        w["k_norm"] = read.required(p + "k_norm", (k_size,))
    return w


def _dense_mlp(read: _Reader, p: str, h: int, inter: int) -> LayerWeights:
    return {"gate_up": read.fused([(p + "gate", (inter, h)), (p + "up", (inter, h))]),
            "down": read.required(p + "down", (h, inter))}


def _moe_mlp(read: _Reader, cfg: ModelConfig, p: str) -> LayerWeights:
    moe, h = cfg.moe, cfg.hidden_size
    e, inter = moe.num_experts, moe.intermediate_size
    gate_up = read.stacked([(p + "experts.gate", (e, inter, h)), (p + "experts.up", (e, inter, h))])
    down = read.stacked([(p + "experts.down", (e, h, inter))])
    if _kind(gate_up) != _kind(down):
        # one kernel call takes both: GGUF blocks, one scaled format, or floats for both
        gate_up, down = (read.where.expert_arrays.place(_floats(x), read.where.dtype)
                         if _kind(x) != "float" else x for x in (gate_up, down))
    w = {"router": read.required(p + "router", (e, h)),
         "experts.gate_up": gate_up, "experts.down": down}
    if moe.shared_intermediate_size:
        shared = _dense_mlp(read, p + "shared.", h, moe.shared_intermediate_size)
        w.update({"shared." + k: v for k, v in shared.items()})
        gate = read.src.get(p + "shared_gate")     # [1, H] in HF files, [H] in GGUF ones
        if gate is not None and _shape(gate) == (h,):
            gate = gate.reshape(1, h)
        w["shared_gate"] = read.check(p + "shared_gate", gate, (1, h))
    return w


def _kind(weight: Weight) -> str:
    if isinstance(weight, QuantWeight):
        return "gguf"
    return weight.format if isinstance(weight, ScaledWeight) else "float"


def _floats(weight: Weight) -> Array:
    return dequantize(weight) if isinstance(weight, QuantWeight) else scaled.dequantize(weight)


def _layer(read: _Reader, cfg: ModelConfig, i: int) -> LayerWeights:
    if cfg.linear is not None:
        from freetoken.models.checkpoint.hybrid_weights import hybrid_layer

        return hybrid_layer(read, cfg, i)
    p = f"layers.{i}."
    w = _attention(read, cfg, p)
    if cfg.is_sparse(i):
        w.update(_moe_mlp(read, cfg, p))
    else:
        w.update(_dense_mlp(read, p, cfg.hidden_size, cfg.intermediate_size))
    return w


def build_decoder_weights(src: TensorSource, cfg: ModelConfig, where: Placement
                          ) -> DecoderWeights:
    """Every tensor of a dense decoder, checked against `cfg` and placed per `where`."""
    read = _Reader(src, where, cfg.architecture)
    embed = read.required("embed", (cfg.vocab_size, cfg.hidden_size))
    if isinstance(embed, ScaledWeight):     # looked up by row: floats, as the kernel reads
        embed = where.arrays.place(scaled.dequantize(embed), where.dtype)
    head = None if cfg.tie_word_embeddings else read.required(
        "lm_head", (cfg.vocab_size, cfg.hidden_size))
    rot = cfg.rope_dim or cfg.head_dim
    freqs = src.get("rope_freqs")
    if freqs is not None and _shape(freqs) != (rot // 2,):
        raise ModelFormatError(f"{src.source}: tensor {src.file_name('rope_freqs')!r} has shape "
                               f"{list(_shape(freqs))}, expected [{rot // 2}]")
    final_norm = read.required("final_norm", (cfg.hidden_size,))
    if cfg.norm_offset:
        from freetoken.models.checkpoint.hybrid_weights import plus_one

        final_norm = plus_one(final_norm)
    return DecoderWeights(
        embed=embed,
        layers=[_layer(read, cfg, i) for i in range(cfg.num_layers)],
        final_norm=final_norm,
        lm_head=embed if head is None else head,
        rope_freq_factors=None if freqs is None else HostArrays().place(freqs, "float32"),
    )
