"""What the server hands the engine for each image: the preprocessed patches, their grid and a
digest of the image's bytes (the prefix cache and the encoder cache key on it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class VisionPreprocess:
    """How a model wants its images: read from the model folder (config.json's vision_config
    and preprocessor_config.json). Pixel limits bound the resized image's area."""

    patch_size: int            # 16 for Qwen3.5/3.6
    temporal_patch_size: int   # 2: a still image is repeated to fill the temporal patch
    merge_size: int            # 2: 2x2 patches become one language-model token
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token: str           # "<|image_pad|>": one per image in the rendered prompt
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image. `pixel_values` is float32 [grid_t * grid_h * grid_w,
    3 * temporal_patch_size * patch_size**2] in exactly the order the HF image processor
    returns; the vision tower consumes it unchanged."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    digest: str   # sha256 hex of the encoded image bytes as received

    def num_tokens(self, merge_size: int) -> int:
        """Language-model tokens this image occupies in the prompt."""
        t, h, w = self.grid_thw
        return t * h * w // (merge_size * merge_size)
