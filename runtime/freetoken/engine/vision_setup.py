"""The engine's side of images: the rotary table's spare rows and the encoder cache at start-up,
and each request's images checked against its prompt at submit time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from freetoken.engine.encoder_cache import EncoderCache
from freetoken.engine.multimodal import MultimodalPrompt, layout_images
from freetoken.engine.request import RequestRejected

# Embedding rows the encoder cache keeps at least (more when a prefill step is larger).
MIN_ENCODER_CACHE_ROWS = 8192


def attach_vision(model: Any, vision: Any, max_step_tokens: int) -> tuple[int, EncoderCache]:
    """Give the decoder spare rotary rows for a step's image tokens and build the encoder
    cache; returns (first spare row, cache). Before any CUDA graph is captured: the graphs
    keep the rotary table they saw."""
    spare = model.enable_mrope(vision.config.mrope_section, vision.config.mrope_interleaved,
                               max_step_tokens)
    return spare, EncoderCache(vision.tower, encoder_cache_rows(max_step_tokens))


def encoder_cache_rows(max_step_tokens: int) -> int:
    """The encoder cache's capacity in embedding rows (the memory plan counts it full)."""
    return max(MIN_ENCODER_CACHE_ROWS, 2 * max_step_tokens)


def check_images(prompt: list[int], images: Sequence[Any], vision: Any,
                 model_name: str) -> MultimodalPrompt | None:
    """The prompt's image layout, None for a text prompt; RequestRejected for images on a
    model without a vision tower or placeholders that do not match the images."""
    if vision is None:
        if images:
            raise RequestRejected(f"model {model_name} does not take images (it has no "
                                  f"vision tower)")
        return None
    pre = vision.preprocess
    if not images and pre.image_token_id not in prompt:
        return None
    for n, image in enumerate(images):
        if tuple(image.pixel_values.shape) != (
                image.grid_thw[0] * image.grid_thw[1] * image.grid_thw[2],
                vision.config.patch_dim):
            raise RequestRejected(f"image {n}: pixel_values of shape "
                                  f"{tuple(image.pixel_values.shape)} do not match its grid "
                                  f"{tuple(image.grid_thw)} and this model's patches")
        if image.grid_thw[1] % pre.merge_size or image.grid_thw[2] % pre.merge_size:
            raise RequestRejected(f"image {n}: grid {tuple(image.grid_thw)} is not a multiple "
                                  f"of the merge size {pre.merge_size}")
    return layout_images(prompt, images, pre)


def warm_up_vision(vision: Any) -> None:
    """Encode one blank image of a single merge block, so the tower's kernels are loaded (or
    compiled) before serving."""
    import numpy as np

    from freetoken.vision.inputs import ImageInput

    cfg = vision.config
    m = cfg.spatial_merge_size
    blank = ImageInput(np.zeros((m * m, cfg.patch_dim), dtype=np.float32), (1, m, m), "warm-up")
    vision.tower.encode([blank])
