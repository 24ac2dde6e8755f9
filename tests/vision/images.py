"""Test images: random pixels in a given mode and size, encoded as PNG, JPEG or WebP, and the
Qwen3.5/3.6 preprocessing settings (preprocessor_config.json of the released models)."""

from __future__ import annotations

import io

import numpy as np

from freetoken.vision.inputs import VisionPreprocess

# preprocessor_config.json of the released Qwen3.5/3.6 folders
QWEN35_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
                       "temporal_patch_size": 2, "merge_size": 2,
                       "size": {"shortest_edge": 65536, "longest_edge": 16777216},
                       "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# The same as the engine reads it. The token ids are stand-ins: preprocessing does not use them.
QWEN35 = VisionPreprocess(
    patch_size=16, temporal_patch_size=2, merge_size=2,
    min_pixels=QWEN35_PREPROCESSOR["size"]["shortest_edge"],
    max_pixels=QWEN35_PREPROCESSOR["size"]["longest_edge"],
    image_mean=tuple(QWEN35_PREPROCESSOR["image_mean"]),
    image_std=tuple(QWEN35_PREPROCESSOR["image_std"]), image_token="<|image_pad|>",
    image_token_id=3, vision_start_token_id=1, vision_end_token_id=2)


def random_image(width: int, height: int, mode: str, seed: int = 0):
    """Random pixels; P gets a palette with one transparent entry, as GIF-like PNGs have."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    if mode in ("RGBA", "LA"):
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        return Image.fromarray(pixels, "RGBA").convert(mode)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        image.info["transparency"] = 5
        return image
    return image.convert(mode)


def encode(image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    if fmt == "PNG" and "transparency" in image.info:
        options.setdefault("transparency", image.info["transparency"])
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def solid_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    from PIL import Image

    return encode(Image.new("RGB", (width, height), rgb), "PNG")
