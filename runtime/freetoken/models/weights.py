"""Checkpoint-neutral decoder weights: loaders name tensors canonically, this module checks
shapes, places them on the device and concatenates q/k/v and gate/up rows once.

Canonical names: ``embed``, ``final_norm``, ``lm_head``, ``rope_freqs`` and per layer
``layers.{i}.`` + ``input_norm q k v q_bias k_bias v_bias q_norm k_norm o post_norm gate up down``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays, is_torch
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.errors import MissingTensorError, ModelFormatError

Array = Any  # a numpy array (CPU, and as read from GGUF) or a torch tensor
Weight = Union[Array, QuantWeight]


class TensorSource(Protocol):
    """What a checkpoint reader offers: tensors by canonical name, and their file names."""

    source: str

    def get(self, name: str) -> Weight | None:
        """The tensor (rows = output features), or None when the checkpoint lacks it."""

    def file_name(self, name: str) -> str:
        """How the checkpoint spells a canonical name (for error messages)."""


@dataclass(frozen=True)
class Placement:
    """Where weights live and in which float dtype; GGUF blocks stay quantized on the CPU."""

    arrays: HostArrays | TorchArrays
    dtype: str                     # float32 | bfloat16 | float16

    @property
    def keeps_quantized(self) -> bool:
        return self.arrays.device.is_cpu


@dataclass
class LayerWeights:
    input_norm: Array
    qkv: list[Weight]            # one fused matrix, or the parts when they cannot concatenate
    qkv_bias: Array | None
    q_norm: Array | None
    k_norm: Array | None
    o: Weight
    post_norm: Array
    gate_up: list[Weight]
    down: Weight


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


def _shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def _place(weight: Weight, where: Placement) -> Weight:
    if isinstance(weight, QuantWeight):
        if where.keeps_quantized:
            return weight
        weight = dequantize(weight)
    return where.arrays.place(weight, where.dtype)


def _fuse_rows(parts: list[Weight]) -> list[Weight]:
    """One matrix when the parts concatenate (same float dtype, or same GGUF block type)."""
    if not any(isinstance(p, QuantWeight) for p in parts):
        return [_concat(parts)]
    if all(isinstance(p, QuantWeight) for p in parts):
        qtypes = {p.qtype for p in parts}
        widths = {p.data.shape[1] for p in parts}
        if len(qtypes) == 1 and len(widths) == 1:
            rows = sum(p.shape[0] for p in parts)
            data = np.concatenate([p.data for p in parts], axis=0)
            return [QuantWeight(parts[0].qtype, data, (rows, parts[0].shape[1]))]
    return parts


def _concat(parts: list[Array]) -> Array:
    """Row concatenation of placed float arrays (all numpy, or all torch on one device)."""
    if is_torch(parts[0]):
        import torch

        return torch.cat(parts, dim=0)
    return np.concatenate(parts, axis=0)


class _Reader:
    """Fetches, checks the shape of and places each tensor."""

    def __init__(self, src: TensorSource, where: Placement, architecture: str):
        self.src, self.where, self.where_config = src, where, architecture

    def optional(self, name: str, shape: tuple[int, ...]) -> Weight | None:
        weight = self.src.get(name)
        if weight is None:
            return None
        if _shape(weight) != shape:
            raise ModelFormatError(
                f"{self.src.source}: tensor {self.src.file_name(name)!r} has shape "
                f"{list(_shape(weight))}, expected {list(shape)} from the model config")
        return _place(weight, self.where)

    def fused(self, parts: list[tuple[str, tuple[int, ...]]]) -> list[Weight]:
        """Required tensors whose rows are concatenated into one matrix when they can be.

        A source with ``release(name)`` may then drop the originals from memory (the GGUF
        reader unmaps their pages), so the file's copies do not count twice in the RSS."""
        weights = [self.required(name, shape) for name, shape in parts]
        fused = _fuse_rows(weights)
        release = getattr(self.src, "release", None)
        if len(fused) == 1 and len(weights) > 1 and release is not None:
            for name, _ in parts:
                release(name)
        return fused

    def required(self, name: str, shape: tuple[int, ...]) -> Weight:
        weight = self.optional(name, shape)
        if weight is None:
            raise MissingTensorError(
                f"{self.src.source}: missing tensor {self.src.file_name(name)!r}; the "
                f"checkpoint is incomplete or does not match its {self.where_config} config")
        return weight


def _layer(read: _Reader, cfg: ModelConfig, i: int) -> LayerWeights:
    p, h = f"layers.{i}.", cfg.hidden_size
    qs, kvs, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv = read.fused([(p + "q", (qs, h)), (p + "k", (kvs, h)), (p + "v", (kvs, h))])
    bias = None
    if cfg.attention_bias:
        bias = _concat([read.required(p + "q_bias", (qs,)), read.required(p + "k_bias", (kvs,)),
                        read.required(p + "v_bias", (kvs,))])
    q_norm = k_norm = None
    if cfg.qk_norm:
        q_norm = read.required(p + "q_norm", (cfg.head_dim,))
        k_norm = read.required(p + "k_norm", (cfg.head_dim,))
    return LayerWeights(
        input_norm=read.required(p + "input_norm", (h,)),
        qkv=qkv, qkv_bias=bias, q_norm=q_norm, k_norm=k_norm,
        o=read.required(p + "o", (h, qs)),
        post_norm=read.required(p + "post_norm", (h,)),
        gate_up=read.fused([(p + "gate", (inter, h)), (p + "up", (inter, h))]),
        down=read.required(p + "down", (h, inter)),
    )


def build_decoder_weights(src: TensorSource, cfg: ModelConfig, where: Placement
                          ) -> DecoderWeights:
    """Every tensor of a dense decoder, checked against `cfg` and placed per `where`."""
    read = _Reader(src, where, cfg.architecture)
    embed = read.required("embed", (cfg.vocab_size, cfg.hidden_size))
    head = None if cfg.tie_word_embeddings else read.required(
        "lm_head", (cfg.vocab_size, cfg.hidden_size))
    rot = cfg.rope_dim or cfg.head_dim
    freqs = src.get("rope_freqs")
    if freqs is not None and _shape(freqs) != (rot // 2,):
        raise ModelFormatError(f"{src.source}: tensor {src.file_name('rope_freqs')!r} has shape "
                               f"{list(_shape(freqs))}, expected [{rot // 2}]")
    return DecoderWeights(
        embed=embed,
        layers=[_layer(read, cfg, i) for i in range(cfg.num_layers)],
        final_norm=read.required("final_norm", (cfg.hidden_size,)),
        lm_head=embed if head is None else head,
        rope_freq_factors=None if freqs is None else HostArrays().place(freqs, "float32"),
    )
