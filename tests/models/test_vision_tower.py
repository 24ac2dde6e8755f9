"""The vision tower against transformers' Qwen3_5MoeVisionModel on a tiny random float32
checkpoint: the merged embeddings of one image and of two images of different sizes in one
batch, plus the vision settings read from the folder (config.json, preprocessor_config.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from freetoken.models.checkpoint.vision_config import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS,
                                                       read_vision_preprocess,
                                                       vision_config_from_hf)
from freetoken.models.errors import ModelFormatError
from tests.models.vision_checkpoint import (IDS, build_vision_model, make_image, random_pixels)


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3_5-vl")
    return directory, build_vision_model(directory)


def load_tower(directory):
    from freetoken.models.vision_model import load_vision
    from freetoken.arrays import parse_device

    return load_vision(directory, parse_device("cpu"), "float32")


def hf_embeddings(hf, images):
    pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in images]))
    grid = torch.tensor([i.grid_thw for i in images])
    with torch.no_grad():
        out = hf.model.get_image_features(pixels.double(), grid)
    return [t.double() for t in out.pooler_output]


def assert_close(ours, ref):
    """float32 against a float64 run: a few float32 roundings per op through two blocks."""
    ours = ours.double()
    scale = ref.abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * max(scale, 1.0), f"max error {err} at magnitude {scale}"


@pytest.mark.parametrize("sizes", [[(64, 96)], [(64, 64), (96, 128)]])
def test_tower_matches_transformers(vision_checkpoint, sizes):
    directory, hf = vision_checkpoint
    images = [make_image(random_pixels(h, w, seed=i)) for i, (h, w) in enumerate(sizes)]
    vision = load_tower(directory)
    ours = vision.tower.encode(images)
    reference = hf_embeddings(hf.double(), images)
    hf.float()
    assert [t.shape[0] for t in ours] == [i.num_tokens(2) for i in images]
    for a, b in zip(ours, reference):
        assert a.shape == b.shape
        assert_close(a, b)


def test_vision_settings_from_folder(vision_checkpoint, tmp_path):
    directory, _ = vision_checkpoint
    raw = json.loads((directory / "config.json").read_text())
    config = vision_config_from_hf(raw, "config.json")
    assert (config.patch_size, config.temporal_patch_size, config.spatial_merge_size) == (16, 2, 2)
    assert config.mrope_section == (3, 3, 2) and config.mrope_interleaved
    pre = read_vision_preprocess(tmp_path, config, "<|image_pad|>")   # no preprocessor file
    assert (pre.min_pixels, pre.max_pixels) == (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert pre.image_token_id == IDS["image_token_id"]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 4096, "longest_edge": 65536}, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3}))
    pre = read_vision_preprocess(tmp_path, config, "<|image_pad|>")
    assert (pre.min_pixels, pre.max_pixels, pre.image_mean) == (4096, 65536, (0.5, 0.5, 0.5))
    (tmp_path / "preprocessor_config.json").write_text('{"image_mean": [0.5]}')
    with pytest.raises(ModelFormatError, match="image_mean"):
        read_vision_preprocess(tmp_path, config, None)
    assert vision_config_from_hf({"model_type": "qwen3_5_moe"}, "x") is None
