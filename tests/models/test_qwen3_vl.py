"""Qwen3-VL (dense qwen3 text model, DeepStack vision features) against transformers'
Qwen3VLForConditionalGeneration on a tiny random float32 checkpoint: the config read from the
folder, the tower's merged embeddings and DeepStack features, and the last-token logits of a
chunked prefill, which must also move when the features are dropped or added a layer late.
Qwen3-VL-MoE: its config (the outer tie_word_embeddings) and its released checkpoints'
transposed expert layout. The engine side (greedy tokens, encoder and prefix caches) runs in
tests/engine/test_vision_engine.py for every vision architecture."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from freetoken.models.checkpoint.hf import read_hf_dir
from freetoken.models.checkpoint.hf_config import config_from_hf
from freetoken.models.checkpoint.vision_config import vision_config_from_hf
from freetoken.models.errors import ModelFormatError
from freetoken.models.forward import decoder
from freetoken.models.loader import load_model
from tests.engine.test_vision_engine import (hf_logits, images_for, prefill_last_logits,
                                             prompt_with)
from tests.models.vision_checkpoint import build_vision_model
from tests.tolerances import assert_close

# float32 against float64 through three vision blocks (or four text layers): each value is a
# sum over at most a few hundred products per layer, rounded again at every layer
TOWER_TERMS = 3 * 256
TEXT_TERMS = 4 * 256


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3-vl")
    hf = build_vision_model(directory, seed=2, arch="qwen3_vl")
    return directory, copy.deepcopy(hf).double()


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(str(checkpoint[0]))


def test_config_from_folder(checkpoint):
    raw = json.loads((checkpoint[0] / "config.json").read_text())
    text = config_from_hf(raw, "config.json")
    assert (text.architecture, text.qk_norm, text.moe, text.linear) == ("qwen3_vl", "head",
                                                                       None, None)
    assert text.rope_theta == 500000.0 and text.rope_dim == 32 and text.intermediate_size == 96
    vision = vision_config_from_hf(raw, "config.json")
    assert vision.deepstack_visual_indexes == (0, 2) and vision.embed_width == 3 * 64
    assert vision.mrope_section == (6, 5, 5) and vision.rope_theta == 10000.0
    assert vision.num_params == sum(p.numel() for p in checkpoint[1].model.visual.parameters())
    bad = {**raw, "vision_config": {**raw["vision_config"], "deepstack_visual_indexes": [0, 3]}}
    with pytest.raises(ModelFormatError, match="deepstack_visual_indexes"):
        vision_config_from_hf(bad, "config.json")
    # transformers' Qwen3.5 tower has no DeepStack mergers: the key means nothing there
    qwen35 = {**raw, "model_type": "qwen3_5_moe"}
    assert vision_config_from_hf(qwen35, "config.json").deepstack_visual_indexes == ()


@pytest.mark.parametrize("sizes", [[(64, 96)], [(64, 64), (96, 128)]])
def test_tower_and_deepstack_features_match_transformers(checkpoint, loaded, sizes):
    hf = checkpoint[1]
    images = images_for(sizes)
    ours = loaded.vision.tower.encode(images)
    pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in images])).double()
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, torch.tensor([i.grid_thw for i in images]))
    assert len(out.deepstack_features) == 2
    for n, image in enumerate(images):
        parts = [out.pooler_output[n]] + [level[n] for level in out.deepstack_features]
        assert ours[n].shape == (image.num_tokens(2), 3 * 64)
        for j, ref in enumerate(parts):
            assert_close(ours[n][:, j * 64:(j + 1) * 64], ref, "float32", terms=TOWER_TERMS,
                         msg=f"image {n} part {j}")


def _logits(loaded, prompt, images, chunk):
    return prefill_last_logits(loaded, prompt, images, chunk)


@pytest.mark.parametrize("sizes", [[(64, 96)], [(96, 64), (128, 96)]])
def test_prefill_logits_match_transformers(checkpoint, loaded, sizes):
    images = images_for(sizes)
    prompt = prompt_with(images)
    ref = hf_logits(checkpoint[1], prompt, images)
    for chunk in (len(prompt), 7):     # whole, and images (and their features) cut by chunks
        assert_close(_logits(loaded, prompt, images, chunk), ref, "float32", terms=TEXT_TERMS,
                     msg=f"chunk {chunk}")


def test_deepstack_features_are_needed_at_their_layers(checkpoint, loaded, monkeypatch):
    """The logits comparison above fails when the features are dropped, or shifted one layer
    late (feature 0 after layer 1, the last one lost): both move the logits by 100 times its
    tolerance and more."""
    images = images_for([(96, 64), (128, 96)])
    prompt = prompt_with(images)
    ref = hf_logits(checkpoint[1], prompt, images)
    add = decoder.add_deepstack
    broken = {"dropped": lambda residual, embeds, level, hidden: None,
              "late": lambda residual, embeds, level, hidden: add(
                  residual, embeds, level - 1, hidden) if level else None}
    for name, patched in broken.items():
        monkeypatch.setattr(decoder, "add_deepstack", patched)
        with pytest.raises(AssertionError):
            assert_close(_logits(loaded, prompt, images, 7), ref, "float32",
                         terms=TEXT_TERMS, ulps=8 * 100, msg=name)
    monkeypatch.setattr(decoder, "add_deepstack", add)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen3-vl-moe")
    hf = build_vision_model(directory, seed=4, arch="qwen3_vl_moe")
    reference = copy.deepcopy(hf).double()
    reference.model.language_model.set_experts_implementation("eager")
    return directory, reference


def test_moe_config_unties_the_head_as_transformers(moe_checkpoint):
    """transformers' Qwen3VLMoeTextConfig defaults tie_word_embeddings to true; the outer
    config's false is what the model does."""
    raw = json.loads((moe_checkpoint[0] / "config.json").read_text())
    assert raw["text_config"]["tie_word_embeddings"] and not raw["tie_word_embeddings"]
    config = config_from_hf(raw, "config.json")
    assert config.architecture == "qwen3_vl_moe" and not config.tie_word_embeddings
    assert config.moe.sparse_layers == (True, True, False, True) and config.moe.renormalize


def test_moe_released_expert_layout(moe_checkpoint, tmp_path, moe_ops):
    """The released checkpoints store gate_up_proj [E, hidden, 2I] and down_proj [E, I,
    hidden] (transformers transposes them at load): the same model either way."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory, hf = moe_checkpoint
    for item in directory.iterdir():
        shutil.copy(item, tmp_path / item.name)
    tensors = load_file(str(directory / "model.safetensors"))
    for name in [n for n in tensors if ".experts." in n]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    plain, released = read_hf_dir(directory)[1], read_hf_dir(tmp_path)[1]
    for part in ("gate", "up", "down"):
        name = f"layers.0.experts.{part}"
        assert torch.equal(plain.get(name), released.get(name))
        assert released.get_part(name, 1, 0, 8) is None        # read whole, then transposed
    images = images_for([(64, 96)])
    prompt = prompt_with(images)
    ours = prefill_last_logits(load_model(str(tmp_path)), prompt, images, 7)
    assert_close(ours, hf_logits(hf, prompt, images), "float32", terms=TEXT_TERMS)
