"""HF model directories: config.json, *.safetensors (sharded or not) and
generation_config.json (the tokenizer files are read by tokenizer/hf.py).

Routed experts are read in any of the layouts checkpoints use (fused ``gate_up_proj`` 3-D
tensors as transformers 5 holds them, separate stacked 3-D tensors, or one module per expert)
and handed on stacked: ``experts.gate``/``experts.up`` [E, I, H], ``experts.down`` [E, H, I]."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from freetoken.models.checkpoint.footprint import FLOAT, StoredTensor
from freetoken.models.checkpoint.hf_config import config_from_hf
from freetoken.models.checkpoint.json_file import read_json
from freetoken.models.checkpoint.hf_quant import (QuantScheme, parse_scheme,
                                                  read_modelopt_config, read_scaled,
                                                  stored_scaled)
from freetoken.models.config import GenerationDefaults, ModelConfig
from freetoken.models.errors import ModelFormatError
from freetoken.models.quant import scaled
from freetoken.models.registry import (HF_EXPERTS_FUSED, HF_EXPERTS_PER_EXPERT,
                                       HF_EXPERTS_STACKED, HF_GLOBAL, HF_LAYER,
                                       HF_TEXT_PREFIXES, ArchSpec, spec_for_hf)


_MTP_PREFIXES = ("mtp.", "model.mtp.")


class HFTensors:
    """Canonical-name access to a directory's safetensors (a ``TensorSource``)."""

    def __init__(self, directory: Path, spec: ArchSpec, config: ModelConfig,
                 scheme: QuantScheme | None = None):
        self.source = str(directory)
        self._scheme = scheme
        self._handles: dict[Path, Any] = {}
        self._file_of = self._index(directory)
        moe = spec.moe
        self._num_experts = config.moe.num_experts if config.moe else 0
        self._projections = moe.hf_expert_projections if moe else ()
        # fused experts as [E, cols, rows] where the spec allows it: (gate_up, down) shapes
        self._transposed_shapes = None
        if moe is not None and moe.hf_fused_transposed:
            hidden, inter = config.hidden_size, config.moe.intermediate_size
            self._transposed_shapes = ((hidden, 2 * inter), (inter, hidden))
        # the sparse block's module name: the first of the spec's spellings the file uses
        modules = moe.hf_modules if moe else ("mlp",)
        self._moe = next((m for m in modules if any(f".{m}.gate." in n for n in self._file_of)),
                         modules[0])
        # a multimodal checkpoint keeps the text model under its own prefix
        self._prefix = next((p for p in HF_TEXT_PREFIXES
                             if f"{p}embed_tokens.weight" in self._file_of), "model.")
        # the multi-token-prediction block (Qwen3-Next, Qwen3.5/3.6): mtp.*, or model.mtp.*
        self._mtp_prefix = next((p for p in _MTP_PREFIXES if f"{p}fc.weight" in self._file_of),
                                None)
        gemma = spec.gemma
        self._layer_names = {**HF_LAYER, **dict(gemma.hf_layer_names if gemma else ())}
        # Gemma's RMSNorm multiplies by (1 + w): the 1 is added once here, so every norm kernel
        # scales by its weight as for the other families
        self._norm_offset = gemma.hf_norm_offset if gemma else 0.0

    def _open(self, file: Path):
        from safetensors import SafetensorError, safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise ModelFormatError(f"{file}: unreadable safetensors file ({exc}); "
                                       f"it may be truncated, download it again") from None
        return self._handles[file]

    def _index(self, directory: Path) -> dict[str, Path]:
        index_file = directory / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = read_json(index_file).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index_file}: missing 'weight_map'")
            return {name: directory / file for name, file in weight_map.items()}
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{directory}: no *.safetensors files (only safetensors "
                                   f"checkpoints are read; convert .bin/.pt weights first)")
        return {name: f for f in files for name in self._open(f).keys()}

    def _layer_name(self, index: str, part: str) -> str:
        return f"{self._prefix}layers.{index}." + self._layer_names[part].format(moe=self._moe)

    def mtp(self) -> HFTensors | None:
        """The MTP block's tensors under the names forward/mtp.py reads: ``mtp.fc``,
        ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``, and its
        decoder layer k as ``layers.{k}.*`` (mtp.layers.{k}.* in the file, named and laid out
        as the text model's layers); None when the checkpoint has no MTP block."""
        if self._mtp_prefix is None:
            return None
        view = copy.copy(self)
        view._prefix = self._mtp_prefix
        return view

    def file_name(self, name: str) -> str:
        if name.startswith("mtp."):
            return f"{self._mtp_prefix or _MTP_PREFIXES[0]}{name[4:]}.weight"
        if not name.startswith("layers."):
            hf_name = HF_GLOBAL.get(name, name)
            if hf_name.startswith("model."):
                return self._prefix + hf_name[len("model."):]
            return hf_name
        _, index, part = name.split(".", 2)
        if not part.startswith("experts."):
            return self._layer_name(index, part)
        every = f"{{0..{max(self._num_experts - 1, 0)}}}"
        layouts = [self._expert_names(index, part[8:], e) for e in ("fused", "stacked", every)]
        return " or ".join(dict.fromkeys(layouts))

    def _expert_names(self, index: str, proj: str, layout: str) -> str:
        prefix = f"{self._prefix}layers.{index}."
        if layout == "fused":
            key = "gate_up" if proj in ("gate", "up") else "down"
            return prefix + HF_EXPERTS_FUSED[key].format(moe=self._moe)
        if layout == "stacked":
            return prefix + HF_EXPERTS_STACKED[proj].format(moe=self._moe)
        which = self._projections[("gate", "up", "down").index(proj)]
        return prefix + HF_EXPERTS_PER_EXPERT.format(moe=self._moe, e=layout, proj=which)

    def _tensor(self, hf_name: str) -> torch.Tensor | scaled.ScaledWeight | None:
        """The tensor `hf_name`, or its scaled weight when the checkpoint stores it so."""
        if self._scheme is None:
            return self._raw(hf_name)
        return read_scaled(self._scheme, hf_name, self._raw, self.source)[1]

    def _raw(self, hf_name: str) -> torch.Tensor | None:
        file = self._file_of.get(hf_name)
        if file is None:
            return None
        if not file.is_file():
            raise ModelFormatError(f"{file}: listed in the safetensors index for {hf_name!r} "
                                   f"but missing")
        return self._open(file).get_tensor(hf_name)

    def get(self, name: str) -> torch.Tensor | None:
        if ".experts." in name:
            _, index, part = name.split(".", 2)
            return self._experts(index, part[8:])
        tensor = self._tensor(self.file_name(name))
        if tensor is not None and self._norm_offset and name.endswith("norm"):
            tensor = tensor.float() + self._norm_offset
        return tensor

    def stored(self, name: str) -> StoredTensor | None:
        """The tensor's format, shape and bytes from the safetensors headers, without reading
        it (footprint.py); None when the checkpoint lacks it."""
        if ".experts." in name:
            _, index, part = name.split(".", 2)
            return self._stored_experts(index, part[8:])
        return stored_scaled(self._scheme, self.file_name(name), self._header)

    def _header(self, hf_name: str) -> tuple[str, list[int]] | None:
        file = self._file_of.get(hf_name)
        if file is None or not file.is_file():
            return None
        view = self._open(file).get_slice(hf_name)
        return view.get_dtype(), view.get_shape()

    def _stored_experts(self, index: str, proj: str) -> StoredTensor | None:
        """[E, rows, cols] of one projection of every expert, from whichever layout exists
        (as _experts reads them)."""
        fused = stored_scaled(self._scheme, self._expert_names(index, proj, "fused"),
                              self._header)
        if fused is not None and self._transposed(fused.shape, proj):
            fused = replace(fused, shape=(fused.shape[0], fused.shape[2], fused.shape[1]))
        if fused is not None and proj != "down":     # gate or up: half of gate_up's rows
            e, rows, cols = fused.shape
            return replace(fused, shape=(e, rows // 2, cols), nbytes=fused.nbytes // 2)
        if fused is not None:
            return fused
        stacked = stored_scaled(self._scheme, self._expert_names(index, proj, "stacked"),
                                self._header)
        if stacked is not None:
            return stacked
        parts = [stored_scaled(self._scheme, self._expert_names(index, proj, str(e)),
                               self._header) for e in range(self._num_experts)]
        if not parts or None in parts:
            return None
        first = parts[0]
        kind = first.kind if all(p.kind == first.kind for p in parts) else FLOAT
        return StoredTensor((len(parts),) + first.shape, kind, sum(p.nbytes for p in parts),
                            kernel_ready=all(p.kernel_ready for p in parts))

    def get_part(self, name: str, dim: int, start: int, end: int) -> torch.Tensor | None:
        """`name` cut to start:end along `dim`, reading only that part of the file (tensor
        parallelism); None where a whole read is needed (scaled weights, offset norms, a range
        past the end) or the tensor is missing: the caller falls back to ``get``."""
        if self._scheme is not None or (self._norm_offset and name.endswith("norm")):
            return None
        if ".experts." not in name:
            return self._part(self.file_name(name), {dim: (start, end)})
        _, index, part = name.split(".", 2)
        proj = part[8:]
        fused = self._expert_names(index, proj, "fused")    # down_proj: the stacked name too
        if fused in self._file_of and self._transposed(
                self._open(self._file_of[fused]).get_slice(fused).get_shape(), proj):
            return None                                         # read whole, then transposed
        whole = self._part(self._expert_names(index, proj, "stacked"), {dim: (start, end)})
        if whole is not None:
            return whole
        if proj != "down" and fused in self._file_of:          # gate rows, then up rows, along dim 1
            half = self._open(self._file_of[fused]).get_slice(fused).get_shape()[1] // 2
            base = 0 if proj == "gate" else half
            cuts = ({1: (base + start, base + end)} if dim == 1 else
                    {1: (base, base + half), dim: (start, end)})
            return self._part(fused, cuts)
        parts = [self._part(self._expert_names(index, proj, str(e)), {dim - 1: (start, end)})
                 for e in range(self._num_experts)]
        return None if not parts or any(p is None for p in parts) else torch.stack(parts)

    def _part(self, hf_name: str, cuts: dict[int, tuple[int, int]]) -> torch.Tensor | None:
        file = self._file_of.get(hf_name)
        if file is None or not file.is_file():
            return None
        view = self._open(file).get_slice(hf_name)
        shape = view.get_shape()
        index = [slice(None)] * len(shape)
        for dim, (start, end) in cuts.items():
            if end > shape[dim]:
                return None
            index[dim] = slice(start, end)
        return view[tuple(index)]

    def _transposed(self, shape, proj: str) -> bool:
        """Whether a fused expert tensor of `shape` is stored [E, cols, rows]; a square one is
        taken as [E, rows, cols], as transformers takes it."""
        if self._transposed_shapes is None:
            return False
        stored = self._transposed_shapes[proj == "down"]
        return tuple(shape[1:]) == stored and stored[0] != stored[1]

    def _experts(self, index: str, proj: str) -> torch.Tensor | None:
        """[E, rows, cols] for one projection of every expert, from whichever layout exists."""
        fused = self._tensor(self._expert_names(index, proj, "fused"))
        if fused is not None and self._transposed(fused.shape, proj):
            if isinstance(fused, scaled.ScaledWeight):
                raise ModelFormatError(f"{self.source}: scaled experts stored transposed "
                                       f"({self._expert_names(index, proj, 'fused')}) are not "
                                       f"supported")
            fused = fused.transpose(1, 2).contiguous()
        if fused is not None and proj != "down":
            half, rows = fused.shape[1] // 2, fused.shape[1]
            if isinstance(fused, scaled.ScaledWeight):
                return scaled.slice_rows(fused, *((0, half) if proj == "gate" else (half, rows)))
            return fused[:, :half] if proj == "gate" else fused[:, half:]
        if fused is not None:
            return fused
        stacked = self._tensor(self._expert_names(index, proj, "stacked"))
        if stacked is not None:
            return stacked
        parts = [self._tensor(self._expert_names(index, proj, str(e)))
                 for e in range(self._num_experts)]
        if not parts or any(p is None for p in parts):
            return None
        if all(isinstance(p, scaled.ScaledWeight) for p in parts):
            return scaled.stack(parts)
        return torch.stack([scaled.dequantize(p) if isinstance(p, scaled.ScaledWeight) else p
                            for p in parts])


def hf_generation_defaults(gen: dict[str, Any]) -> GenerationDefaults:
    """Sampling defaults from generation_config.json; do_sample=false means greedy."""
    known = ("temperature", "top_k", "top_p", "max_new_tokens", "do_sample")
    temperature = gen.get("temperature")
    if gen.get("do_sample") is False:
        temperature = 0.0
    return GenerationDefaults(
        temperature=None if temperature is None else float(temperature),
        top_k=None if gen.get("top_k") is None else int(gen["top_k"]),
        top_p=None if gen.get("top_p") is None else float(gen["top_p"]),
        max_tokens=None if gen.get("max_new_tokens") is None else int(gen["max_new_tokens"]),
        extra={k: v for k, v in gen.items() if k not in known},
    )


def read_hf_dir(directory: Path
                ) -> tuple[ModelConfig, HFTensors, dict[str, Any], dict[str, Any]]:
    """(config, tensors, config.json, generation_config.json) of a model directory; weights
    are read lazily through HFTensors."""
    raw = read_json(directory / "config.json")
    source = str(directory / "config.json")
    config = config_from_hf(raw, source)
    scheme = parse_scheme(raw, read_modelopt_config(directory), source)
    gen = read_json(directory / "generation_config.json", required=False)
    return config, HFTensors(directory, spec_for_hf(raw, source), config, scheme), raw, gen
