"""A vision-language folder's vision settings: the tower's shape (config.json's vision_config),
the image placeholder ids and the multimodal rotary layout (text_config.rope_parameters), and
how images are preprocessed (preprocessor_config.json). Text-only folders have none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.models.checkpoint.json_file import read_json
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.vision.inputs import VisionPreprocess

# The HF Qwen2-VL image processor's defaults, used when a folder has no
# preprocessor_config.json: 56*56 to 28*28*1280 pixels and the OpenAI CLIP mean/std.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
DEFAULT_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"


@dataclass(frozen=True)
class VisionFamily:
    """What transformers' model of a config.json model_type assumes: the mrope_section when
    text_config gives none, and whether its tower has DeepStack mergers (Qwen3.5's has none
    and ignores deepstack_visual_indexes)."""

    mrope_section: tuple[int, int, int]
    deepstack: bool


VISION_MODEL_TYPES = {"qwen3_5_moe": VisionFamily((11, 11, 10), deepstack=False),
                      "qwen3_vl": VisionFamily((24, 20, 20), deepstack=True),
                      "qwen3_vl_moe": VisionFamily((24, 20, 20), deepstack=True)}


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (Qwen3-VL, Qwen3.5/3.6: a ViT with 2-D rotary and a 2x2 patch merger)
    and what the text model needs to place its output (placeholder ids, multimodal rotary
    layout). Qwen3-VL's DeepStack: the outputs of the blocks `deepstack_visual_indexes` go
    through mergers of their own and are added to the text model's hidden states at the
    image tokens after its first len(indexes) layers (forward/deepstack.py)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    num_position_embeddings: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def embed_width(self) -> int:
        """Columns of an image's embedding rows: the merger's output, then each DeepStack
        feature in block order (one row per image token carries them all)."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of pixel_values: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def num_params(self) -> int:
        """Every weight of the tower (model.visual.*): patch embedding, position table, the
        blocks and the patch merger."""
        h, i = self.hidden_size, self.intermediate_size
        block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        merged = h * self.spatial_merge_size ** 2
        mlp = (merged * merged + merged) + (merged * self.out_hidden_size + self.out_hidden_size)
        merger = 2 * h + mlp
        deepstack = len(self.deepstack_visual_indexes) * (2 * merged + mlp)   # norm after shuffle
        return (h * self.patch_dim + h + self.num_position_embeddings * h
                + self.depth * block + merger + deepstack)


def _int(section: dict, key: str, where: str, default: Any = None) -> int:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFormatError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def _vision_section(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    vision = raw.get("vision_config")
    if vision is None:
        return None
    if not isinstance(vision, dict):
        raise ModelFormatError(f"{source}: 'vision_config' must be an object")
    if raw.get("model_type") not in VISION_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: a vision tower of model_type {raw.get('model_type')!r} is not supported "
            f"(supported: {', '.join(VISION_MODEL_TYPES)})")
    return vision


def _deepstack(raw: dict[str, Any], depth: int, where: str) -> tuple[int, ...]:
    if not VISION_MODEL_TYPES[raw["model_type"]].deepstack:
        return ()
    indexes = raw["vision_config"].get("deepstack_visual_indexes") or []
    if (not isinstance(indexes, list)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth
                       for i in indexes) or len(set(indexes)) != len(indexes)):
        raise ModelFormatError(f"{where}: deepstack_visual_indexes must be distinct block "
                               f"indexes below depth {depth}, got {indexes!r}")
    return tuple(indexes)


def _mrope(raw: dict[str, Any], source: str) -> tuple[tuple[int, int, int], bool]:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section", list(VISION_MODEL_TYPES[raw["model_type"]].mrope_section))
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(s, int) and s >= 0 for s in section)):
        raise ModelFormatError(f"{source}: mrope_section must be three non-negative integers, "
                               f"got {section!r}")
    return tuple(section), bool(rope.get("mrope_interleaved", True))


def vision_config_from_hf(raw: dict[str, Any], source: str) -> VisionConfig | None:
    """The vision tower described by config.json, or None for a text-only model."""
    vision = _vision_section(raw, source)
    if vision is None:
        return None
    where = f"{source}: vision_config"
    rope = vision.get("rope_parameters") or {}
    section, interleaved = _mrope(raw, source)
    config = VisionConfig(
        depth=_int(vision, "depth", where, 27), hidden_size=_int(vision, "hidden_size", where, 1152),
        num_heads=_int(vision, "num_heads", where, 16),
        intermediate_size=_int(vision, "intermediate_size", where, 4304),
        out_hidden_size=_int(vision, "out_hidden_size", where, 3584),
        num_position_embeddings=_int(vision, "num_position_embeddings", where, 2304),
        patch_size=_int(vision, "patch_size", where, 16),
        temporal_patch_size=_int(vision, "temporal_patch_size", where, 2),
        spatial_merge_size=_int(vision, "spatial_merge_size", where, 2),
        in_channels=_int(vision, "in_channels", where, 3),
        hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        image_token_id=_int(raw, "image_token_id", source, 248056),
        vision_start_token_id=_int(raw, "vision_start_token_id", source, 248053),
        vision_end_token_id=_int(raw, "vision_end_token_id", source, 248054),
        mrope_section=section, mrope_interleaved=interleaved,
        deepstack_visual_indexes=_deepstack(raw, _int(vision, "depth", where, 27), where))
    if config.hidden_size % config.num_heads or config.head_dim % 8 or config.head_dim > 128:
        raise UnsupportedModelError(f"{where}: head_dim {config.head_dim} (hidden_size / "
                                    f"num_heads) must be a multiple of 8 up to 128")
    if config.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"{where}: hidden_act {config.hidden_act!r} is not supported")
    if round(config.num_position_embeddings ** 0.5) ** 2 != config.num_position_embeddings:
        raise ModelFormatError(f"{where}: num_position_embeddings must be a square")
    return config


def vision_settings(source: str | None) -> tuple[VisionConfig, VisionPreprocess] | None:
    """The tower's shape and preprocessing of a model folder, from its JSON files alone (the
    start-up memory plan counts the tower before any weight is read); None without one."""
    if not source_has_vision(source):
        return None
    directory = Path(source).expanduser()
    config = vision_config_from_hf(read_json(directory / "config.json"),
                                   str(directory / "config.json"))
    return config, read_vision_preprocess(directory, config, None)


def source_has_vision(source: str | None) -> bool | None:
    """Whether a model source has a vision tower, from config.json alone (no weights read):
    False for a GGUF file or the default model, None when it cannot be told here (a missing or
    unreadable folder; loading it reports why)."""
    if source is None:
        return False
    path = Path(source).expanduser()
    if path.is_file():
        return False
    try:
        raw = read_json(path / "config.json")
    except ModelFormatError:
        return None
    return raw.get("vision_config") is not None


def _triple(pre: dict, key: str, default: tuple, where: Path) -> tuple[float, float, float]:
    value = pre.get(key, default)
    if (not isinstance(value, (list, tuple)) or len(value) != 3
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
        raise ModelFormatError(f"{where}: {key!r} must be three numbers, got {value!r}")
    return tuple(float(x) for x in value)


def read_vision_preprocess(directory: Path, config: VisionConfig,
                           image_token: str | None) -> VisionPreprocess:
    """How images are resized and normalised for `config`: preprocessor_config.json's
    min/max pixels (`min_pixels`/`max_pixels` or `size.shortest_edge`/`size.longest_edge`),
    image_mean and image_std, the HF Qwen2-VL processor's defaults where absent."""
    path = directory / "preprocessor_config.json"
    pre = read_json(path, required=False)
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    min_pixels = pre.get("min_pixels", size.get("shortest_edge", DEFAULT_MIN_PIXELS))
    max_pixels = pre.get("max_pixels", size.get("longest_edge", DEFAULT_MAX_PIXELS))
    for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ModelFormatError(f"{path}: {key} must be a positive integer, got {value!r}")
    if min_pixels > max_pixels:
        raise ModelFormatError(f"{path}: min_pixels {min_pixels} exceeds max_pixels {max_pixels}")
    return VisionPreprocess(
        patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
        merge_size=config.spatial_merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
        image_mean=_triple(pre, "image_mean", DEFAULT_IMAGE_MEAN, path),
        image_std=_triple(pre, "image_std", DEFAULT_IMAGE_STD, path),
        image_token=image_token or DEFAULT_IMAGE_TOKEN, image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id)
