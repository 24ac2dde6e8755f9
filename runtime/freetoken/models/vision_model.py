"""``load_vision``: a vision-language folder's tower, settings and preprocessing, or None for a
text-only folder. Kept apart from loader.py so text-only loading never touches it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.models.checkpoint.vision_config import (VisionConfig, read_vision_preprocess,
                                                       vision_config_from_hf)
from freetoken.models.forward.vision import VisionTower
from freetoken.vision.inputs import VisionPreprocess


@dataclass(frozen=True)
class VisionModel:
    """What the engine needs for images: the tower, its settings and the preprocessing."""

    config: VisionConfig
    preprocess: VisionPreprocess
    tower: VisionTower


def load_vision(directory: Path, device: Any, dtype: str, tokenizer: Any = None,
                raw_config: dict | None = None) -> VisionModel | None:
    """The vision tower of an HF folder on `device` in `dtype` (float32 on the CPU), or None
    when config.json has no vision_config. Raises ModelFormatError / MissingTensorError /
    UnsupportedModelError naming the file and the field."""
    import torch

    from freetoken.models.checkpoint.json_file import read_json
    from freetoken.models.checkpoint.vision_weights import read_vision_weights

    directory = Path(directory)
    raw = raw_config if raw_config is not None else read_json(directory / "config.json")
    config = vision_config_from_hf(raw, str(directory / "config.json"))
    if config is None:
        return None
    token = None
    if tokenizer is not None:
        token = tokenizer.backend.id_to_token(config.image_token_id)
    preprocess = read_vision_preprocess(directory, config, token)
    where, kind = torch.device(str(device)), getattr(torch, dtype)
    weights = read_vision_weights(directory, config,
                                  lambda t: t.to(device=where, dtype=kind).contiguous())
    return VisionModel(config, preprocess, VisionTower(config, weights, device, dtype))
