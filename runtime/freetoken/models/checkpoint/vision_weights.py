"""The vision tower's weights (``model.visual.*``) read from the model's safetensors folder,
placed on the device in the tower's dtype: one flat dict keyed by the names under
``model.visual.`` (``blocks.0.attn.qkv.weight``, ``merger.linear_fc1.bias``, ...; Qwen3-VL
adds ``deepstack_merger_list.{j}.*``, one merger per DeepStack feature)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken.models.checkpoint.vision_config import VisionConfig
from freetoken.models.errors import MissingTensorError, ModelFormatError

PREFIX = "model.visual."


def _block_names(i: int) -> list[str]:
    parts = ("norm1", "norm2", "attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
    return [f"blocks.{i}.{p}.{kind}" for p in parts for kind in ("weight", "bias")]


def expected_names(config: VisionConfig) -> list[str]:
    """Every tensor the tower reads (under model.visual.)."""
    names = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"]
    for i in range(config.depth):
        names += _block_names(i)
    mergers = ["merger"] + [f"deepstack_merger_list.{j}"
                            for j in range(len(config.deepstack_visual_indexes))]
    for merger in mergers:
        for part in ("norm", "linear_fc1", "linear_fc2"):
            names += [f"{merger}.{part}.weight", f"{merger}.{part}.bias"]
    return names


def _files(directory: Path) -> dict[str, Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFormatError(f"{index}: unreadable weight_map ({exc})") from None
        return {n: directory / f for n, f in weight_map.items() if n.startswith(PREFIX)}
    from safetensors import safe_open

    found: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            found.update((n, file) for n in handle.keys() if n.startswith(PREFIX))
    return found


def read_vision_weights(directory: Path, config: VisionConfig, place: Any) -> dict[str, Any]:
    """{name: place(tensor)} for every tensor in `expected_names`; `place` puts a torch
    tensor on the device in the tower's dtype. Raises MissingTensorError naming the first
    missing tensor, ModelFormatError for a tensor of the wrong shape."""
    from safetensors import safe_open

    files = _files(directory)
    by_file: dict[Path, list[str]] = {}
    for name in expected_names(config):
        if PREFIX + name not in files:
            raise MissingTensorError(f"{directory}: the vision tower needs {PREFIX + name}, "
                                     f"which no safetensors file holds")
        by_file.setdefault(files[PREFIX + name], []).append(name)
    weights = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                weights[name] = handle.get_tensor(PREFIX + name)
    _check_shapes(weights, config, directory)
    return {name: place(tensor) for name, tensor in weights.items()}


def _check_shapes(weights: dict, config: VisionConfig, where: Path) -> None:
    hidden, merged = config.hidden_size, config.hidden_size * config.spatial_merge_size ** 2
    wanted = {"patch_embed.proj.weight": (hidden, config.in_channels, config.temporal_patch_size,
                                          config.patch_size, config.patch_size),
              "pos_embed.weight": (config.num_position_embeddings, hidden),
              "blocks.0.attn.qkv.weight": (3 * hidden, hidden),
              "blocks.0.mlp.linear_fc1.weight": (config.intermediate_size, hidden),
              "merger.linear_fc1.weight": (merged, merged),
              "merger.linear_fc2.weight": (config.out_hidden_size, merged)}
    for j in range(len(config.deepstack_visual_indexes)):   # normed after the 2x2 shuffle
        wanted[f"deepstack_merger_list.{j}.norm.weight"] = (merged,)
        wanted[f"deepstack_merger_list.{j}.linear_fc2.weight"] = (config.out_hidden_size, merged)
    for name, shape in wanted.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise ModelFormatError(f"{where}: {PREFIX + name} has shape "
                                   f"{tuple(weights[name].shape)}; the vision_config says {shape}")
