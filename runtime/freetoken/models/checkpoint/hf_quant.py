"""Scaled low-precision HF checkpoints: which scheme a directory uses, and its weights read as
``ScaledWeight`` (models/quant/scaled.py).

Schemes (from config.json's ``quantization_config``, or ModelOpt's ``hf_quant_config.json``):

- ``quant_method: fp8`` (Qwen, DeepSeek): e4m3 weights with ``weight_scale_inv``, a float32
  grid of one scale per ``weight_block_size`` block (ceil-div at the edges), or one per tensor
  when no block size is given. Despite its name the scale multiplies the weight.
- ``compressed-tensors``, 8-bit ``float`` weights (``float-quantized``): ``weight_scale`` per
  tensor ([1]), per channel ([O, 1]) or per block (``block_structure``); 4-bit ``float``
  ``tensor_group`` weights with group size 16 (``nvfp4-pack-quantized``): ``weight_packed``
  (two e2m1 per byte), e4m3 ``weight_scale`` [O, I/16] and ``weight_global_scale``, which
  divides (value = e2m1 * weight_scale / weight_global_scale).
- ModelOpt ``quant_algo: FP8``: e4m3 weights with a scalar ``weight_scale``; ``NVFP4``: packed
  ``weight``, e4m3 ``weight_scale`` [O, I/16] and ``weight_scale_2``, which multiplies.

Only tensors stored in a low-precision dtype are read as scaled weights: whatever a scheme
leaves out (embeddings, norms, router gates, its ignore/exclude list) is stored in bf16 and
stays a float tensor. Activation scales (``input_scale``) are not needed: activations stay in
the model's float dtype (weight-only dequantization).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from freetoken.models.checkpoint.footprint import FLOAT, StoredTensor
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.quant.scaled import FP8, NVFP4, ScaledWeight, takes_layout

METHODS = ("fp8", "compressed-tensors", "modelopt")
NVFP4_GROUP = 16


@dataclass(frozen=True)
class QuantScheme:
    """How one checkpoint stores its scaled weights (the tensor-name suffixes included)."""

    method: str                          # fp8 | compressed-tensors | modelopt
    format: str                          # FP8 | NVFP4
    strategy: str                        # tensor | channel | block | group
    block: tuple[int, int] | None = None  # block strategy: (rows, cols) per scale
    scale: str = "weight_scale"          # companion tensor holding the scales
    packed: str = "weight"               # the quantized values' own name
    global_scale: str = ""               # NVFP4 second-level scale ("" for FP8)
    global_divides: bool = False         # compressed-tensors stores 1 / the global scale


def _refuse(source: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{source}: {what} is not supported (supported: quant_method fp8 with e4m3 weights, "
        f"compressed-tensors FP8 (tensor, channel or block scales) or NVFP4, ModelOpt FP8 or "
        f"NVFP4)")


def _fp8_method(quant: dict, source: str) -> QuantScheme:
    fmt = str(quant.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _refuse(source, f"quant_method 'fp8' with fmt {fmt!r}")
    block = quant.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", FP8, "tensor", scale="weight_scale_inv")
    return QuantScheme("fp8", FP8, "block", _block(block, source), scale="weight_scale_inv")


def _block(value: Any, source: str) -> tuple[int, int]:
    if isinstance(value, str):           # older compressed-tensors spell it "128x128"
        value = value.lower().split("x")
    try:
        rows, cols = (int(v) for v in value)
    except (TypeError, ValueError):
        raise ModelFormatError(f"{source}: weight block size {value!r} is not [rows, cols]") \
            from None
    if rows <= 0 or cols <= 0:
        raise ModelFormatError(f"{source}: weight block size {value!r} must be positive")
    return rows, cols


def _compressed_tensors(quant: dict, source: str) -> QuantScheme:
    groups = quant.get("config_groups") or {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    weights = [w for w in weights if w]
    if not weights:
        raise _refuse(source, "compressed-tensors without weight quantization")
    kinds = {json.dumps(w, sort_keys=True) for w in weights}
    if len(kinds) != 1:
        raise _refuse(source, "compressed-tensors with several weight schemes")
    w = weights[0]
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if bits == 8 and kind == "float" and strategy in ("tensor", "channel", "block"):
        block = _block(w.get("block_structure"), source) if strategy == "block" else None
        return QuantScheme("compressed-tensors", FP8, strategy, block)
    if bits == 4 and kind == "float" and strategy == "tensor_group" and \
            int(w.get("group_size") or 0) == NVFP4_GROUP:
        return QuantScheme("compressed-tensors", NVFP4, "group", (1, NVFP4_GROUP),
                           packed="weight_packed", global_scale="weight_global_scale",
                           global_divides=True)
    raise _refuse(source, f"compressed-tensors {bits}-bit {kind} weights with strategy "
                          f"{strategy!r} (format {quant.get('format')!r})")


def _modelopt(algo: Any, group: Any, source: str) -> QuantScheme:
    if algo == "FP8":
        return QuantScheme("modelopt", FP8, "tensor")
    if algo == "NVFP4":
        if group is not None and int(group) != NVFP4_GROUP:
            raise _refuse(source, f"ModelOpt NVFP4 with group_size {group}")
        return QuantScheme("modelopt", NVFP4, "group", (1, NVFP4_GROUP),
                           global_scale="weight_scale_2")
    raise _refuse(source, f"ModelOpt quant_algo {algo!r}")


def parse_scheme(cfg: dict[str, Any], modelopt: dict[str, Any] | None, source: str
                 ) -> QuantScheme | None:
    """The scheme of config.json `cfg` (and hf_quant_config.json's ``quantization`` section,
    when given), or None for a float checkpoint. Raises UnsupportedModelError by name."""
    quant = cfg.get("quantization_config")
    if quant is None and not modelopt:
        return None
    if quant is not None and not isinstance(quant, dict):
        raise ModelFormatError(f"{source}: quantization_config must be a JSON object")
    quant = quant or {}
    method = quant.get("quant_method", "modelopt" if modelopt else "unknown")
    if method == "fp8":
        return _fp8_method(quant, source)
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    if method == "modelopt":
        section = {**(modelopt or {}), **quant}
        return _modelopt(section.get("quant_algo"), section.get("group_size"), source)
    raise _refuse(source, f"quantization_config quant_method {method!r}")


def read_modelopt_config(directory: Path) -> dict[str, Any] | None:
    """hf_quant_config.json's ``quantization`` section, or None when the file is absent."""
    path = directory / "hf_quant_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not valid JSON ({exc})") from None
    section = value.get("quantization") if isinstance(value, dict) else None
    if not isinstance(section, dict):
        raise ModelFormatError(f"{path}: missing the 'quantization' object")
    return section


def companion(name: str, suffix: str) -> str:
    """The tensor beside weight `name` called `suffix`: ``x.weight`` -> ``x.<suffix>``;
    a 3-D expert tensor ``x.gate_up_proj`` -> ``x.gate_up_proj_scale`` for ``weight_scale``."""
    if name.endswith(".weight"):
        return name[:-len("weight")] + suffix
    return name + suffix[len("weight"):]


Fetch = Callable[[str], Any]   # HF tensor name -> torch tensor or None


def read_scaled(scheme: QuantScheme, name: str, fetch: Fetch, source: str
                ) -> tuple[bool, Any]:
    """(True, ScaledWeight) when `name` is stored scaled; (False, the tensor or None) else."""
    import torch

    packed = companion(name, scheme.packed) if scheme.packed != "weight" else name
    data = fetch(packed)
    if data is None and packed != name:
        return False, fetch(name)
    if data is None or data.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return False, data
    scale_name = companion(name, scheme.scale)
    scale = fetch(scale_name)
    if scale is None:
        raise ModelFormatError(f"{source}: {packed!r} is stored as {data.dtype} but its scale "
                               f"{scale_name!r} is missing")
    if scheme.format == FP8:
        return True, _fp8(scheme, data, scale, f"{source}: {scale_name!r}")
    global_name = companion(name, scheme.global_scale)
    second = fetch(global_name)
    if second is None:
        raise ModelFormatError(f"{source}: NVFP4 weight {packed!r} has no {global_name!r}")
    return True, _nvfp4(scheme, data, scale, second, f"{source}: {packed!r}")


def _fp8(scheme: QuantScheme, data, scale, where: str) -> ScaledWeight:
    import torch

    if data.dtype != torch.float8_e4m3fn:
        raise UnsupportedModelError(f"{where}: FP8 weights must be float8_e4m3fn, got "
                                    f"{data.dtype}")
    lead, (rows, cols) = tuple(data.shape[:-2]), tuple(data.shape[-2:])
    count = 1
    for n in lead:
        count *= n
    grid, shape = scale.to(torch.float32), tuple(data.shape)
    if grid.numel() == count:
        return ScaledWeight(FP8, data, grid.reshape(*lead, 1, 1), shape, (rows, cols))
    if scheme.strategy == "channel" and grid.numel() == count * rows:
        return ScaledWeight(FP8, data, grid.reshape(*lead, rows, 1), shape, (1, cols))
    if scheme.strategy == "block":
        bn, bk = scheme.block
        expected = lead + (-(-rows // bn), -(-cols // bk))
        if tuple(grid.shape) == expected:
            return ScaledWeight(FP8, data, grid.contiguous(), shape, (bn, bk))
    raise ModelFormatError(f"{where} has shape {list(grid.shape)}, which is no {scheme.strategy} "
                           f"scale layout of a {list(data.shape)} weight"
                           + (f" with blocks {list(scheme.block)}" if scheme.block else ""))


def _nvfp4(scheme: QuantScheme, data, scale, second, where: str) -> ScaledWeight:
    import torch

    if data.dtype != torch.uint8:
        raise ModelFormatError(f"{where}: NVFP4 values must be uint8 (two e2m1 per byte), got "
                               f"{data.dtype}")
    lead, rows, cols = tuple(data.shape[:-2]), data.shape[-2], 2 * data.shape[-1]
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    if scale.dtype != torch.float8_e4m3fn or cols % NVFP4_GROUP or \
            tuple(scale.shape) != lead + (rows, cols // NVFP4_GROUP):
        raise ModelFormatError(f"{where}: its scales must be float8_e4m3fn "
                               f"{list(lead + (rows, cols // NVFP4_GROUP))}, got {scale.dtype} "
                               f"{list(scale.shape)}")
    count = 1
    for n in lead:
        count *= n
    if second.numel() != count:
        raise ModelFormatError(f"{where}: expected one second-level scale per tensor, got "
                               f"{list(second.shape)}")
    per_tensor = second.to(torch.float32).reshape(*lead, 1)
    if scheme.global_divides:
        per_tensor = 1.0 / per_tensor
    row_scale = per_tensor.expand(*lead, rows).contiguous()
    return ScaledWeight(NVFP4, data, scale.contiguous(), lead + (rows, cols),
                        (1, NVFP4_GROUP), row_scale)


# ---- the same, from the safetensors headers alone (the memory plan: footprint.py) ----------

# safetensors dtype names -> bytes per element
SAFETENSORS_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                    "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8,
                    "I64": 8, "BOOL": 1}
_FLOAT_DTYPES = ("F32", "F16", "BF16")
Header = Callable[[str], Any]   # HF name -> (safetensors dtype, shape), or None when absent


def _count(shape) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def stored_plain(head) -> StoredTensor | None:
    """A float tensor of header `head` (dtype, shape); None when absent."""
    if head is None:
        return None
    dtype, shape = head
    return StoredTensor(tuple(shape), FLOAT, _count(shape) * SAFETENSORS_ITEM.get(dtype, 4))


def stored_scaled(scheme: QuantScheme | None, name: str, header: Header
                  ) -> StoredTensor | None:
    """What read_scaled reads for `name`, described from the headers: the values and their
    scales as the reader keeps them. None when absent (or when read_scaled would refuse it,
    which the load then does by name)."""
    if scheme is None:
        return stored_plain(header(name))
    packed = companion(name, scheme.packed) if scheme.packed != "weight" else name
    data = header(packed)
    if data is None and packed != name:
        return stored_plain(header(name))
    if data is None or data[0] in _FLOAT_DTYPES:
        return stored_plain(data)
    scale = header(companion(name, scheme.scale))
    if scale is None:
        return None
    if scheme.format == FP8:
        return _stored_fp8(scheme, tuple(data[1]), tuple(scale[1]))
    return _stored_nvfp4(tuple(data[1]), tuple(scale[1]))


def _stored_fp8(scheme: QuantScheme, shape: tuple, grid_shape: tuple) -> StoredTensor | None:
    """As _fp8: one e4m3 byte a value and the scale grid in float32 (converted at load)."""
    rows, cols = shape[-2:]
    count, grid = _count(shape[:-2]), _count(grid_shape)
    if grid == count or (scheme.strategy == "channel" and grid == count * rows):
        block_cols = cols
    elif scheme.strategy == "block":
        block_cols = scheme.block[1]
    else:
        return None
    return StoredTensor(shape, FP8, _count(shape) + 4 * grid,
                        kernel_ready=takes_layout(cols, block_cols))


def _stored_nvfp4(shape: tuple, scale_shape: tuple) -> StoredTensor:
    """As _nvfp4: two e2m1 values a byte, an e4m3 scale per 16 values and a float32 row scale
    (the per-tensor second-level scale, one per row)."""
    lead, rows, cols = shape[:-2], shape[-2], 2 * shape[-1]
    nbytes = _count(shape) + _count(scale_shape) + 4 * _count(lead) * rows
    return StoredTensor(lead + (rows, cols), NVFP4, nbytes,
                        kernel_ready=takes_layout(cols, NVFP4_GROUP))
