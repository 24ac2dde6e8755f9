"""A decoded image -> the patches the vision tower takes, as the model's HF image processor makes
them (Qwen2VLImageProcessor settings: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5/3.6).

The steps follow transformers 5.x's Qwen2VLImageProcessorPil exactly: RGB with transparency
composited onto white, `smart_resize` to multiples of patch_size * merge_size, Pillow's bicubic
resize of the uint8 image, rescale by 1/255 (float64, then float32), normalize in float32, the
frame repeated to fill the temporal patch, then the patches in merge-window order."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np

from freetoken.vision.decode import MAX_DECODED_PIXELS, ImageTooLarge, open_image
from freetoken.vision.inputs import ImageInput, VisionPreprocess

if TYPE_CHECKING:
    from PIL import Image

MAX_ASPECT_RATIO = 200   # smart_resize's own limit


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the area within [min_pixels,
    max_pixels] and the aspect ratio kept as closely as that allows (HF's rule, to the
    rounding: Python's round() is round-half-even there too)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageTooLarge(f"the image is {width}x{height}: its aspect ratio is over "
                            f"{MAX_ASPECT_RATIO}:1, which the model's processor cannot resize")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with alpha (or a transparent palette entry) is composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def normalized_pixels(image: Image.Image, size: tuple[int, int],
                      config: VisionPreprocess) -> np.ndarray:
    """float32 [3, height, width]: resized (bicubic), rescaled to [0, 1], normalized."""
    from PIL import Image

    height, width = size
    resized = to_rgb(image).resize((width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(resized).transpose(2, 0, 1)
    # NOTE: HF rescales in float64 and rounds to float32 once; float32 throughout can differ
    # in the last bit, which normalize then doubles.
    scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    return (scaled - mean) / std


def patchify(pixels: np.ndarray, config: VisionPreprocess) -> tuple[np.ndarray, tuple]:
    """[3, H, W] -> ([grid_h * grid_w, 3 * T * P * P], (1, grid_h, grid_w)).

    Rows run over merge windows (merge x merge neighbouring patches, row-major inside each
    window, windows row-major over the image); each row is channel, then the T copies of the
    frame, then the P x P pixels of the patch."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    channels, height, width = pixels.shape
    grid_h, grid_w = height // p, width // p
    blocks = pixels.reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)   # [gh/m, gw/m, m, m, C, P, P]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t, p, p))
    rows = np.ascontiguousarray(frames).reshape(grid_h * grid_w, channels * t * p * p)
    return rows, (1, grid_h, grid_w)


def preprocess(image: Image.Image, config: VisionPreprocess, digest: str,
               max_pixels: int | None = None) -> ImageInput:
    """One decoded image as the vision tower's input; `max_pixels` (default: the model's)
    bounds the resized area."""
    factor = config.patch_size * config.merge_size
    width, height = image.size
    size = smart_resize(height, width, factor, config.min_pixels,
                        config.max_pixels if max_pixels is None else max_pixels)
    rows, grid = patchify(normalized_pixels(image, size, config), config)
    return ImageInput(pixel_values=rows, grid_thw=grid, digest=digest)


def preprocess_bytes(data: bytes, config: VisionPreprocess, media_type: str | None = None,
                     max_pixels: int | None = None,
                     max_decoded_pixels: int = MAX_DECODED_PIXELS) -> ImageInput:
    """Encoded bytes as received -> ImageInput (digest: sha256 of those bytes). Raises an
    ImageError subclass for anything a request should be told about."""
    image = open_image(data, media_type, max_decoded_pixels)
    return preprocess(image, config, hashlib.sha256(data).hexdigest(), max_pixels)
