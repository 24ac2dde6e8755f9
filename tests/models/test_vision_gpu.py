"""On a GPU: the vision tower at Qwen3.5/3.6's real vision width (1152, 16 heads of 72,
MLP 4304, 2304 learned positions; depth cut to 2) in bfloat16 against transformers in float32,
for one image and for two images of different sizes in one batch, and the last-token logits of
a prompt with an image through the engine's prefill path; for each vision architecture
(Qwen3-VL's with both blocks feeding DeepStack features)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.models.bf16_reference import Bf16Errors, bf16_twins
from tests.models.vision_checkpoint import (ARCHES, TEXT, TEXT_VL, build_vision_model,
                                            hf_inputs, make_image, random_pixels)
from tests.tolerances import eps

REAL_VISION = dict(depth=2, hidden_size=1152, num_heads=16, intermediate_size=4304,
                   num_position_embeddings=2304, out_hidden_size=64)

# The small text part at head sizes the GPU kernels take (attention and Gated DeltaNet heads of
# 64); rotary over 16 of the 64 dims keeps TEXT's [3, 3, 2] multimodal sections.
GPU_TEXT = dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                rope_parameters=dict(TEXT["rope_parameters"], partial_rotary_factor=0.25))
# Qwen3-VL rotates all 64 dims: 32 frequencies in sections of [12, 10, 10]
GPU_TEXT_VL = dict(head_dim=64, rope_parameters=dict(TEXT_VL["rope_parameters"],
                                                     mrope_section=[12, 10, 10]))

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=ARCHES)
def real_checkpoint(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp(f"{request.param}-real-vision")
    vl = request.param != "qwen3_5_moe"
    vision = dict(REAL_VISION, deepstack_visual_indexes=[0, 1]) if vl else REAL_VISION
    hf = build_vision_model(directory, seed=2, vision=vision,
                            text=GPU_TEXT_VL if vl else GPU_TEXT, arch=request.param)
    with torch.no_grad():    # the default init's scale (0.08 noise over width 1152 explodes)
        for name, p in hf.model.visual.named_parameters():
            if name.endswith("weight") and p.dim() >= 2:
                p.mul_(0.4 / math.sqrt(p.shape[-1] if p.dim() == 2 else p[0].numel()) / 0.08)
    hf.save_pretrained(directory)
    return directory, hf.cuda().float().eval()


def _bound(ref: torch.Tensor, layers: int) -> float:
    """bfloat16 activations: a few roundings of the output's magnitude per layer."""
    return 4 * eps(torch.bfloat16) * ref.abs().max().item() * math.sqrt(layers + 2)


def _per_image(rows, counts: list[int]):
    """transformers' features per image: some 5.x releases return Qwen3-VL's as one tensor over
    all images' rows (5.17 does), others already split per image (5.25)."""
    return rows.split(counts) if isinstance(rows, torch.Tensor) else rows


@pytest.mark.parametrize("sizes", [[(256, 256)], [(224, 320), (512, 384)]])
def test_tower_bf16_matches_transformers(real_checkpoint, sizes):
    from freetoken.arrays import parse_device
    from freetoken.models.vision_model import load_vision

    directory, hf = real_checkpoint
    images = [make_image(random_pixels(h, w, i)) for i, (h, w) in enumerate(sizes)]
    vision = load_vision(directory, parse_device("cuda"), "bfloat16")
    ours = vision.tower.encode(images)
    pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in images])).cuda()
    grid = torch.tensor([i.grid_thw for i in images]).cuda()
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, grid)
    counts = [a.shape[0] for a in ours]
    pooled = _per_image(out.pooler_output, counts)
    levels = getattr(out, "deepstack_features", None) or []
    features = [_per_image(level, counts) for level in levels]
    for n, a in enumerate(ours):
        assert a.dtype == torch.bfloat16
        parts = [pooled[n]] + [level[n] for level in features]
        for j, b in enumerate(parts):        # the embeddings, then each DeepStack feature
            got = a[:, j * b.shape[1]:(j + 1) * b.shape[1]]
            assert got.shape == b.shape
            err = (got.float() - b).abs().max().item()
            assert err <= _bound(b, REAL_VISION["depth"]), f"part {j}: max error {err}"


@pytest.fixture(scope="module")
def bf16_references(real_checkpoint):
    """transformers in bfloat16, and in float32 over the same bf16-rounded weights."""
    return bf16_twins(real_checkpoint[1])


def test_engine_prefill_logits_bf16(real_checkpoint, bf16_references, moe_ops):
    """The engine's bf16 prefill of an image prompt against transformers in float32 over the
    bf16-rounded weights, within twice transformers' own bf16 error (bf16_reference.py).
    Against the float32 weights the error is 2.35 at logits of magnitude 4, but so is
    transformers' own bf16 error (2.30 on the CPU; 2.20 from rounding the weights alone):
    this random hybrid text part flips near-tied expert choices under any bf16 rounding."""
    from freetoken.models.loader import load_model
    from tests.engine.test_vision_engine import prefill_last_logits, prompt_with

    directory, _ = real_checkpoint
    hf16, hf_rounded = bf16_references
    loaded = load_model(str(directory), device="cuda", dtype="bfloat16")
    images = [make_image(random_pixels(320, 256, 5))]
    errors = Bf16Errors()
    for seed in range(3):
        prompt = prompt_with(images, seed=seed)
        ours = prefill_last_logits(loaded, prompt, images, 16)
        inputs = {k: v.cuda() for k, v in hf_inputs(prompt, images).items()}
        with torch.no_grad():
            theirs, ref = (m(**inputs).logits[0, -1] for m in (hf16, hf_rounded))
        errors.add(ours, theirs, ref)
    errors.check()


def test_engine_prefill_logits_float32(real_checkpoint, moe_ops):
    """The same prompt in float32: the GPU path (tower, image embeddings, multimodal rotary,
    chunked prefill) against transformers without bfloat16's rounding in the way."""
    from freetoken.models.loader import load_model
    from tests.engine.test_vision_engine import prefill_last_logits, prompt_with

    directory, hf = real_checkpoint
    loaded = load_model(str(directory), device="cuda", dtype="float32")
    images = [make_image(random_pixels(320, 256, 5))]
    prompt = prompt_with(images)
    ours = prefill_last_logits(loaded, prompt, images, 16).float()
    inputs = {k: v.cuda() for k, v in hf_inputs(prompt, images).items()}
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].float().cpu()
    err = (ours - ref).abs().max().item()
    # float32 sums in another order (and TF32-free GEMMs): far under one bf16 rounding
    assert err <= 1e-3 * ref.abs().max().item() * math.sqrt(REAL_VISION["depth"] + 6), \
        f"max logit error {err}"


def test_engine_greedy_with_graphs_matches_eager(real_checkpoint, moe_ops):
    """Decode of an image request on CUDA graphs and the fused decode kernels (positions with
    the request's rope delta) gives the tokens of eager decode; the first token is
    transformers' float32 argmax where its margin exceeds the bf16 error."""
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model
    from tests.engine.test_vision_engine import prompt_with

    directory, hf = real_checkpoint
    images = [make_image(random_pixels(256, 320, 9))]
    prompt = prompt_with(images)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        loaded = load_model(str(directory), device="cuda", dtype="bfloat16")
        engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=2048, block_size=16,
                                                         cuda_graphs=graphs)).start()
        try:
            async def run():
                return [t async for out in engine.generate(prompt, params, images=images)
                        for t in out.token_ids]
            runs.append(asyncio.run(run()))
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]
    inputs = {k: v.cuda() for k, v in hf_inputs(prompt, images).items()}
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1].float().cpu()
    top2 = ref.topk(2).values
    if (top2[0] - top2[1]).item() > 2 * _bound(ref, REAL_VISION["depth"] + 4):
        assert runs[0][0] == int(ref.argmax())
