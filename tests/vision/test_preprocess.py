"""Preprocessing against transformers' own Qwen2-VL image processor on the same images.

The reference is `Qwen2VLImageProcessorPil` (transformers 5.x), the processor class that
Qwen3.5/3.6's preprocessor_config.json selects when torchvision is absent. Its steps are the
ones ours takes, operation for operation: the same Pillow BICUBIC resize of the same uint8
image, a float64 rescale rounded once to float32, a float32 normalize. So the comparison is
exact (zero tolerance): any difference is a different operation, not rounding.
The torchvision variant (`Qwen2VLImageProcessor`, used when torchvision is installed) resizes
with torch's antialiased bicubic instead of Pillow's; see the last test for its tolerance."""

from __future__ import annotations

import dataclasses
import hashlib
import io

import numpy as np
import pytest

from freetoken.vision.decode import ImageTooLarge
from freetoken.vision.preprocess import preprocess, preprocess_bytes, smart_resize
from tests.vision.images import QWEN35, encode, random_image, solid_png

# Qwen2-VL's max_pixels (1280 * 28 * 28) with Qwen3.5's patches: small images reach the
# scaling-down branch of smart_resize.
SMALL_MAX = dataclasses.replace(QWEN35, max_pixels=1280 * 28 * 28)

SIZES_MODES = [(256, 256, "RGB"), (300, 200, "RGBA"), (37, 517, "L"), (1000, 700, "P"),
               (640, 480, "LA"), (3, 5, "RGB"), (1500, 1100, "RGB"), (33, 2100, "RGBA")]


def hf_processor(config, backend: str = "pil"):
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    kwargs = dict(size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
                  patch_size=config.patch_size, temporal_patch_size=config.temporal_patch_size,
                  merge_size=config.merge_size, image_mean=list(config.image_mean),
                  image_std=list(config.image_std))
    if backend == "pil":
        return pil.Qwen2VLImageProcessorPil(**kwargs)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(**kwargs)


def reference(config, image, backend: str = "pil"):
    out = hf_processor(config, backend)(images=[image], return_tensors="np")
    return np.asarray(out["pixel_values"]), tuple(int(x) for x in out["image_grid_thw"][0])


@pytest.mark.parametrize("config", [QWEN35, SMALL_MAX], ids=["qwen35", "small-max"])
@pytest.mark.parametrize("width,height,mode", SIZES_MODES)
def test_matches_transformers_on_decoded_images(config, width, height, mode):
    image = random_image(width, height, mode, seed=width * 7 + height)
    ours = preprocess(image, config, digest="-")
    expected, grid = reference(config, image)
    assert ours.grid_thw == grid
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.flags.c_contiguous
    np.testing.assert_array_equal(ours.pixel_values, expected)
    assert ours.num_tokens(config.merge_size) * config.merge_size ** 2 == np.prod(grid)


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"),
                                      ("PNG", "L"), ("JPEG", "RGB"), ("JPEG", "L"),
                                      ("WEBP", "RGB"), ("WEBP", "RGBA")])
def test_matches_transformers_from_encoded_bytes(fmt, mode):
    """The bytes path: decode (first frame, EXIF orientation applied) then preprocess; the
    reference decodes the same bytes with Pillow as transformers' load_image does."""
    from PIL import Image, ImageOps

    data = encode(random_image(419, 283, mode, seed=3), fmt, **(
        {"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    ours = preprocess_bytes(data, SMALL_MAX, media_type=f"image/{fmt.lower()}")
    expected, grid = reference(SMALL_MAX, ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    assert ours.grid_thw == grid
    np.testing.assert_array_equal(ours.pixel_values, expected)
    assert ours.digest == hashlib.sha256(data).hexdigest()


def test_smart_resize_agrees_with_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    sides = [1, 15, 16, 31, 32, 48, 80, 112, 255, 256, 257, 333, 1000, 1024, 3000, 4097]
    for config in (QWEN35, SMALL_MAX):
        factor = config.patch_size * config.merge_size
        for h in sides:
            for w in sides:
                if max(h, w) / min(h, w) > 200:
                    with pytest.raises(ImageTooLarge, match="aspect ratio"):
                        smart_resize(h, w, factor, config.min_pixels, config.max_pixels)
                    continue
                got = smart_resize(h, w, factor, config.min_pixels, config.max_pixels)
                assert got == hf(h, w, factor, config.min_pixels, config.max_pixels), (h, w)
                assert got[0] % factor == 0 and got[1] % factor == 0


def test_max_pixels_bounds_the_resized_area():
    image = random_image(1600, 900, "RGB")
    full = preprocess(image, QWEN35, "-")
    capped = preprocess(image, QWEN35, "-", max_pixels=300_000)
    _, h, w = capped.grid_thw
    assert h * w * QWEN35.patch_size ** 2 <= 300_000 < 1600 * 900
    assert full.grid_thw == (1, 900 // 16 // 2 * 2, 1600 // 16 // 2 * 2)  # nearest multiples
    expected, grid = reference(dataclasses.replace(QWEN35, max_pixels=300_000), image)
    assert capped.grid_thw == grid
    np.testing.assert_array_equal(capped.pixel_values, expected)


def test_deployment_check_red_square():
    """The deployment check's 256x256 solid red PNG: 16x16 patches, 64 tokens; every patch row
    is red's normalized value (+1) for the 2*16*16 red entries, then -1 for green and blue."""
    data = solid_png(256, 256, (255, 0, 0))
    image = preprocess_bytes(data, QWEN35, "image/png")
    assert image.grid_thw == (1, 16, 16) and image.num_tokens(2) == 64
    assert image.pixel_values.shape == (256, 3 * 2 * 16 * 16)
    row = np.concatenate([np.ones(512, np.float32), -np.ones(1024, np.float32)])
    np.testing.assert_array_equal(image.pixel_values, np.broadcast_to(row, (256, 1536)))
    assert image.digest == hashlib.sha256(data).hexdigest()


def test_torchvision_processor_within_one_resize_rounding():
    """transformers' default processor when torchvision is installed resizes with torch's
    antialiased bicubic on uint8, built to reproduce Pillow's filter; its fixed-point weights
    round differently, so an output pixel may differ by a uint8 level, and bicubic's negative
    lobes (weights summing to 1 in absolute value ~1.25) can carry one more. Bound: 2 levels
    (2/255 before normalize, / std after) at most, a quarter level on average. Only images
    without alpha: the torchvision backend composites alpha in float, a separate rounding."""
    pytest.importorskip("torchvision")
    std = min(QWEN35.image_std)
    for width, height, mode in [(300, 200, "RGB"), (37, 517, "L"), (1500, 1100, "RGB")]:
        image = random_image(width, height, mode, seed=width)
        ours = preprocess(image, SMALL_MAX, "-")
        expected, grid = reference(SMALL_MAX, image, backend="torchvision")
        assert ours.grid_thw == grid
        diff = np.abs(ours.pixel_values - expected)
        assert diff.max() <= 2 / 255 / std + 1e-6
        assert diff.mean() <= 0.25 / 255 / std
