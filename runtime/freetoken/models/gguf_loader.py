"""GGUF files: metadata -> ModelConfig, tensors -> weights (GGUF blocks kept as raw rows,
zero-copy from the memory map where no reordering is needed), vocabulary -> Tokenizer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freetoken.models.config import GenerationDefaults, ModelConfig, QuantWeight
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.registry import ArchSpec, config_from_gguf, spec_for_gguf
from freetoken.models.weights import Weight

# GGML type ids this runtime reads (gguf.GGMLQuantizationType values).
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
QUANT_TYPES = (Q4_0, Q4_1, Q8_0)
SUPPORTED_TYPES = "F32, F16, BF16, Q4_0, Q4_1, Q8_0"

_GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                 "lm_head": "output.weight", "rope_freqs": "rope_freqs.weight"}
_LAYER_NAMES = {
    "input_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight",
    "v": "attn_v.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "o": "attn_output.weight", "post_norm": "ffn_norm.weight", "gate": "ffn_gate.weight",
    "up": "ffn_up.weight", "down": "ffn_down.weight",
}


def _reader_class():
    """GGUFReader over a plain ndarray view of the map: parsing is ~5x faster than over
    np.memmap (whose per-slice Python hook dominates), and the last key read is tracked
    so a truncated file names where it ends."""
    from gguf import GGUFReader

    class Reader(GGUFReader):
        last_key = "header"

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

        def _push_field(self, field, skip_sum=False):
            self.last_key = field.name
            return super()._push_field(field, skip_sum)

        def _build_tensors(self, start_offs, fields):
            _check_extents(len(self.data), start_offs, fields)
            self.last_key = "tensor data"
            super()._build_tensors(start_offs, fields)

    return Reader


class _TensorPastEnd(Exception):
    """A tensor's bytes run past the end of the file (the file is truncated)."""


def _check_extents(size: int, start: int, fields) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for field in fields:
        _, name, _, dims, raw_type, offset = field.parts
        try:
            block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
        except (ValueError, KeyError):
            continue   # an unknown type id: reported when the tensor is used
        end = start + int(offset[0]) + int(np.prod(dims)) * type_bytes // block
        if end > size:
            raise _TensorPastEnd(bytes(name).decode("utf-8", "replace"))


def open_gguf(path: Path):
    """A GGUFReader for `path`; a truncated or corrupt file raises ModelFormatError."""
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such GGUF file")
    cls = _reader_class()
    reader = cls.__new__(cls)    # kept even when __init__ fails, to report where it stopped
    try:
        reader.__init__(path, "c")   # copy-on-write: writable arrays, the file is untouched
        return reader
    except _TensorPastEnd as exc:
        raise ModelFormatError(f"{path}: tensor {str(exc)!r} ends past the end of the file "
                               f"({path.stat().st_size} bytes); the file is truncated, "
                               f"download it again") from None
    except Exception as exc:   # the reader raises ValueError/IndexError/KeyError on bad bytes
        where = reader.last_key
        raise ModelFormatError(
            f"{path}: not a readable GGUF file ({path.stat().st_size} bytes); it is truncated "
            f"or corrupt after {where!r} ({type(exc).__name__}: {exc}); download it again"
        ) from None


def read_metadata(reader) -> dict[str, Any]:
    """Every key/value field as plain Python values (arrays as lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's interleaved-rope permutation of q/k rows."""
    half = rows // n_head // 2
    index = torch.arange(rows).view(n_head, half, 2).transpose(1, 2).reshape(rows)
    return index


class GGUFTensors:
    """Canonical-name access to a GGUF file's tensors (a ``TensorSource``)."""

    def __init__(self, reader, path: Path, spec: ArchSpec, config: ModelConfig):
        self.source = str(path)
        self._by_name = {t.name: t for t in reader.tensors}
        self._spec, self._config = spec, config

    def file_name(self, name: str) -> str:
        if name.startswith("layers."):
            _, index, part = name.split(".", 2)
            return f"blk.{index}.{_LAYER_NAMES[part]}"
        return _GLOBAL_NAMES[name]

    def get(self, name: str) -> Weight | None:
        tensor = self._by_name.get(self.file_name(name))
        if tensor is None:
            return None
        weight = self._to_weight(tensor)
        if self._spec.gguf_permuted_qk and name.endswith((".q", ".k")):
            heads = self._config.num_heads if name.endswith(".q") else self._config.num_kv_heads
            weight = _take_rows(weight, _unpermute_index(weight.shape[0], heads))
        return weight

    def _to_weight(self, tensor) -> Weight:
        qtype = int(tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))   # GGML lists ne0 (cols) first
        data = torch.from_numpy(tensor.data)
        if qtype in QUANT_TYPES:
            return QuantWeight(qtype, data.view(shape[0], -1), (shape[0], shape[-1]))
        if qtype in (F32, F16):
            return data.view(shape)
        if qtype == BF16:
            return data.view(torch.bfloat16).view(shape)
        raise UnsupportedModelError(
            f"{self.source}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
            f"is not supported; supported: {SUPPORTED_TYPES} (re-quantize the model)")


def _take_rows(weight: Weight, index: torch.Tensor) -> Weight:
    if isinstance(weight, QuantWeight):
        return QuantWeight(weight.qtype, weight.data.index_select(0, index), weight.shape)
    return weight.index_select(0, index)


def gguf_generation_defaults(meta: dict[str, Any]) -> GenerationDefaults:
    """Sampling defaults from general.sampling.* (written by newer converters), if any."""
    def number(key: str, kind):
        value = meta.get(f"general.sampling.{key}")
        return None if value is None else kind(value)

    return GenerationDefaults(temperature=number("temp", float), top_k=number("top_k", int),
                              top_p=number("top_p", float))


def read_gguf(path: Path) -> tuple[ModelConfig, GGUFTensors, dict[str, Any]]:
    """(config, tensor source, metadata) of a GGUF file; weights are not placed yet."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    spec = spec_for_gguf(str(meta.get("general.architecture")), str(path))
    vocab = len(meta.get("tokenizer.ggml.tokens") or [])
    config = config_from_gguf(meta, vocab, str(path))
    tied = not any(t.name == _GLOBAL_NAMES["lm_head"] for t in reader.tensors)
    config = dataclasses.replace(config, tie_word_embeddings=tied)
    return config, GGUFTensors(reader, path, spec, config), meta
