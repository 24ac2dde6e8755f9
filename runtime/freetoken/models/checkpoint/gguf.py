"""GGUF files: metadata -> ModelConfig, tensors -> weights (GGUF blocks kept as raw rows,
zero-copy from the memory map where no reordering is needed; llama.cpp's stacked expert tensors
keep their leading expert axis). The vocabulary is read by tokenizer/gguf.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from freetoken.models.checkpoint import gguf_hybrid
from freetoken.models.checkpoint.footprint import FLOAT, GGUF, StoredTensor
from freetoken.models.checkpoint.gguf_config import config_from_gguf, gguf_spec
from freetoken.models.checkpoint.weights import Weight
from freetoken.models.config import GenerationDefaults, ModelConfig, QuantWeight
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.registry import GGUF_GLOBAL, GGUF_LAYER, ArchSpec

# GGML type ids this runtime reads (gguf.GGMLQuantizationType values).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
# Kept as blocks on the CPU (kernels/include/freetoken/quant_kblocks.h), dequantized elsewhere.
QUANT_TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
SUPPORTED_TYPES = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"


def open_gguf(path: Path):
    """The parsed GGUFFile at `path`, or, for the first part of a split model, every part
    read as one (checkpoint/gguf_split.py); a truncated or corrupt file raises
    ModelFormatError."""
    from freetoken.models.checkpoint.gguf_split import open_split

    return open_split(_open_one(path), path, _open_one)


def _open_one(path: Path):
    from freetoken.models.checkpoint.gguf_file import GGUFFile, GGUFParseError, TensorPastEnd

    if not path.is_file():
        raise ModelFormatError(f"{path}: no such GGUF file")
    try:
        return GGUFFile(path)
    except TensorPastEnd as exc:
        raise ModelFormatError(f"{path}: tensor {exc.where!r} ends past the end of the file "
                               f"({path.stat().st_size} bytes); the file is truncated, "
                               f"download it again") from None
    except GGUFParseError as exc:
        raise ModelFormatError(
            f"{path}: not a readable GGUF file ({path.stat().st_size} bytes); it is truncated "
            f"or corrupt after {exc.where!r} ({exc}); download it again") from None


def _unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """Row order that undoes llama.cpp's interleaved-rope permutation of q/k rows."""
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, half, 2).transpose(0, 2, 1).reshape(rows)


class GGUFTensors:
    """Canonical-name access to a GGUF file's tensors (a ``TensorSource``)."""

    def __init__(self, file, path: Path, spec: ArchSpec, config: ModelConfig):
        self.source = str(path)
        self._file = file
        self._by_name = file.tensors
        self._spec, self._config = spec, config
        overrides = spec.hybrid.gguf_layer_names if spec.hybrid is not None else ()
        self._layer_names = {**GGUF_LAYER, **dict(overrides)}

    def file_name(self, name: str) -> str:
        if name.startswith("layers."):
            _, index, part = name.split(".", 2)
            return f"blk.{index}.{self._layer_names[part]}"
        if name.startswith("mtp."):
            return gguf_hybrid.mtp_file_name(name, self._config.num_layers)
        return GGUF_GLOBAL[name]

    def mtp(self) -> gguf_hybrid.MTPBlocks | None:
        """The MTP block's tensors (gguf_hybrid.MTPBlocks), or None when the file has none."""
        return gguf_hybrid.mtp_view(self, self._config.num_layers)

    def get(self, name: str) -> Weight | None:
        tensor = self._by_name.get(self.file_name(name))
        if tensor is None:
            return None
        weight = self._to_weight(tensor)
        if self._spec.gguf_permuted_qk and name.endswith((".q", ".k")):
            heads = self._config.num_heads if name.endswith(".q") else self._config.num_kv_heads
            weight = _take_rows(weight, _unpermute_index(weight.shape[0], heads))
        part = name.split(".", 2)[-1]
        if part.startswith("gdn.") and self._config.linear is not None:
            weight = gguf_hybrid.canonical(part, weight, self._config.linear, tensor.name,
                                           self.source)
        return weight

    def stored(self, name: str) -> StoredTensor | None:
        """The tensor's type, shape and bytes from the tensor table (footprint.py); None when
        the file lacks it."""
        if self._config.linear is None and name.split(".", 2)[-1].startswith("gdn."):
            return None      # another family's tensor of that name is not a GDN weight
        tensor = self._by_name.get(self.file_name(name))
        if tensor is None or tensor.nbytes is None:
            return None
        shape = tuple(reversed(tensor.dims))
        if tensor.type_id in (F32, F16, BF16):
            return StoredTensor(shape, FLOAT, tensor.nbytes)
        return StoredTensor(shape, GGUF, tensor.nbytes, tensor.type_id)

    def release(self, name: str) -> None:
        """The caller copied this tensor: its file pages may leave memory."""
        tensor = self._by_name.get(self.file_name(name))
        if tensor is not None:
            self._file.release(tensor)

    def _to_weight(self, tensor) -> Weight:
        qtype = tensor.type_id
        shape = tuple(reversed(tensor.dims))   # GGML lists ne0 (cols) first
        if qtype not in QUANT_TYPES + (F32, F16, BF16):
            from freetoken.models.checkpoint.gguf_file import type_name

            raise UnsupportedModelError(
                f"{self.source}: tensor {tensor.name!r} has type {type_name(qtype)}, which "
                f"is not supported; supported: {SUPPORTED_TYPES} (re-quantize the model)")
        data = self._file.array(tensor)
        if qtype in QUANT_TYPES:   # [..., rows, row_bytes]: stacked experts keep their E axis
            return QuantWeight(qtype, data.reshape(*shape[:-1], -1), shape)
        if qtype == BF16:   # numpy has no bfloat16: widen to float32 (exact)
            data = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return data.reshape(shape)


def _take_rows(weight: Weight, index: np.ndarray) -> Weight:
    if isinstance(weight, QuantWeight):
        return QuantWeight(weight.qtype, weight.data[index], weight.shape)
    return weight[index]


def gguf_generation_defaults(meta: dict[str, Any]) -> GenerationDefaults:
    """Sampling defaults from general.sampling.* (written by newer converters), if any."""
    def number(key: str, kind):
        value = meta.get(f"general.sampling.{key}")
        return None if value is None else kind(value)

    return GenerationDefaults(temperature=number("temp", float), top_k=number("top_k", int),
                              top_p=number("top_p", float))


def read_gguf(path: Path) -> tuple[ModelConfig, GGUFTensors, dict[str, Any]]:
    """(config, tensor source, metadata) of a GGUF file; weights are not placed yet."""
    file = open_gguf(path)
    meta = file.meta
    spec = gguf_spec(meta, str(path))
    vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    config = config_from_gguf(meta, vocab, str(path), file.tensors.keys())
    tied = GGUF_GLOBAL["lm_head"] not in file.tensors
    config = dataclasses.replace(config, tie_word_embeddings=tied)
    return config, GGUFTensors(file, path, spec, config), meta
