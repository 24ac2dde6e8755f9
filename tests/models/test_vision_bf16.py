"""A bfloat16 prefill with images on the CPU: the tiny random vision-language model of each
architecture (Qwen3.5-style, Qwen3-VL and Qwen3-VL-MoE with DeepStack features) placed in torch
CPU tensors in bfloat16 (the GPU placement's code: image embeddings written into the residual,
DeepStack features added to it, multimodal rotary rows, the tower in bf16, with the CPU
kernels' bf16 variants standing in for the CUDA ones) against transformers, as
tests/models/bf16_reference.py describes. ``ft serve`` on the CPU computes in float32 only;
this covers the bf16 image path that a GPU serves, where it can run here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.engine.test_vision_engine import prefill_last_logits, prompt_with
from tests.models.bf16_reference import Bf16Errors, bf16_twins
from tests.models.vision_checkpoint import (ARCHES, build_vision_model, hf_inputs, make_image,
                                            random_pixels)

# one image of 16 tokens, one of 12 beside one of 6, over a few prompts each
CASES = [([(128, 128)], 0), ([(128, 128)], 1), ([(96, 128), (64, 96)], 2),
         ([(128, 96)], 3)]


@pytest.fixture(scope="module", params=ARCHES)
def models(tmp_path_factory, request):
    """(transformers in bf16, in float32 over the bf16-rounded weights, ours in bf16)."""
    from freetoken.kernel import ops, reference

    directory = tmp_path_factory.mktemp(f"tiny-{request.param}-bf16")
    hf = build_vision_model(directory, seed=1, arch=request.param)
    with pytest.MonkeyPatch.context() as patch:
        # the CPU experts kernel is float32-only: its torch reference (f32 math, bf16 out)
        for name in ("moe_topk_softmax", "moe_experts"):
            patch.setattr(ops, name, getattr(reference, name))
        ours = _load_bf16_on_host(directory)
    return (*bf16_twins(hf), ours)


def _load_bf16_on_host(directory):
    from freetoken.arrays import TorchArrays, parse_device
    from freetoken.models import loader
    from freetoken.models.checkpoint.hf import read_hf_dir
    from freetoken.models.checkpoint.weights import Placement
    from freetoken.models.vision_model import load_vision

    config, tensors, _, _ = read_hf_dir(directory)
    placement = Placement(TorchArrays(parse_device("cpu")), "bfloat16")
    model = loader._build_model(tensors, config, placement)
    vision = load_vision(directory, parse_device("cpu"), "bfloat16")
    return SimpleNamespace(model=model, vision=vision, config=config)


def _logits(hf, prompt, images):
    with torch.no_grad():
        return hf(**hf_inputs(prompt, images)).logits[0, -1].float()


def test_bf16_prefill_with_images_matches_transformers(models):
    hf16, hf_rounded, ours = models
    assert ours.model.dtype == "bfloat16"
    assert ours.vision.tower.dtype == torch.bfloat16
    errors = Bf16Errors()
    for sizes, seed in CASES:
        images = [make_image(random_pixels(h, w, seed + i)) for i, (h, w) in enumerate(sizes)]
        prompt = prompt_with(images, seed=seed)
        mine = prefill_last_logits(ours, prompt, images, 16)   # image runs cut across chunks
        errors.add(mine, _logits(hf16, prompt, images), _logits(hf_rounded, prompt, images))
    errors.check()
