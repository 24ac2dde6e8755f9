"""Images through the engine on tiny random vision-language models of each architecture
(Qwen3.5-style, Qwen3-VL and Qwen3-VL-MoE with DeepStack features; float32 on the CPU) against
transformers' own model in float64: the last-token logits of a chunked prefill with one image
and with two images of different sizes (image placeholders cut across chunks), greedy tokens
with the multimodal rotary offset in decode, the encoder and prefix caches keyed by the image,
and the request checks."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.encoder_cache import EncoderCache
from freetoken.engine.engine import Engine
from freetoken.engine.multimodal import layout_images
from freetoken.engine.prepare import prepare_forward_batch
from freetoken.engine.request import RequestRejected, SamplingParams
from freetoken.engine.scheduler import ScheduledChunk
from freetoken.models.batch import KVCache
from freetoken.models.loader import load_model
from tests.models.vision_checkpoint import (ARCHES, IDS, build_vision_model, expand_prompt,
                                            hf_inputs, make_image, random_pixels)

NEW_TOKENS = 5
BLOCK = 8


@pytest.fixture(scope="module", params=ARCHES)
def checkpoint(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}-engine")
    hf = build_vision_model(directory, seed=1, arch=request.param)
    reference = copy.deepcopy(hf)
    if request.param != "qwen3_vl":     # routed experts: the plain loop, float64-exact
        reference.model.language_model.set_experts_implementation("eager")
    return directory, reference.double()


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(str(checkpoint[0]))


def images_for(sizes, seed=0):
    return [make_image(random_pixels(h, w, seed + i)) for i, (h, w) in enumerate(sizes)]


def prompt_with(images, seed=0):
    gen = np.random.default_rng(seed)
    texts = [gen.integers(3, 250, n).tolist() for n in [5] + [4] * len(images)]
    return expand_prompt(texts, images)


def hf_logits(hf, prompt, images):
    with torch.no_grad():
        return hf(**hf_inputs(prompt, images)).logits[0, -1]


def prefill_last_logits(loaded, prompt, images, chunk):
    """Our model over `prompt` in chunks of `chunk` tokens; the last token's logits."""
    model, vision = loaded.model, loaded.vision
    spare = model.enable_mrope(vision.config.mrope_section, vision.config.mrope_interleaved,
                               64)
    cache = EncoderCache(vision.tower, 1 << 20)
    pages = -(-len(prompt) // BLOCK)
    kv = KVCache(model.config, pages, BLOCK, model.dtype, model.arrays, num_state_slots=1,
                 state_dtype=model.dtype)
    request = SimpleNamespace(num_computed=0, token_ids=prompt, pages=list(range(pages)),
                              page_rows=None, state_slot=0,
                              mm=layout_images(prompt, images, vision.preprocess))
    model.reserve(chunk)
    while request.num_computed < len(prompt):
        size = min(chunk, len(prompt) - request.num_computed)
        plan = [ScheduledChunk(request, size)]
        batch = prepare_forward_batch(plan, BLOCK, model.arrays, True, spare)
        if batch.multimodal is not None:
            cache.fill(batch.multimodal)
        logits = model.forward(batch, kv)
        request.num_computed += size
    row = logits[0]
    return row.double().cpu() if torch.is_tensor(row) else torch.from_numpy(
        np.array(row, dtype=np.float64))


def assert_logits_close(ours, ref):
    """float32 through two vision blocks and four text layers against float64."""
    err = (ours - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2e-4 * max(scale, 1.0), f"max logit error {err} at magnitude {scale}"


@pytest.mark.parametrize("sizes", [[(64, 96)], [(96, 64), (128, 96)]])
def test_prefill_logits_match_transformers(checkpoint, loaded, sizes, moe_ops):
    images = images_for(sizes)
    prompt = prompt_with(images)
    ref = hf_logits(checkpoint[1], prompt, images)
    for chunk in (len(prompt), 7):     # whole, and images cut across chunks
        assert_logits_close(prefill_last_logits(loaded, prompt, images, chunk), ref)


def hf_greedy(hf, prompt, images):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            seq.append(int(hf(**hf_inputs(seq, images)).logits[0, -1].argmax()))
    return seq[len(prompt):]


def generate(engine, prompt, images):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run():
        outs = [out async for out in engine.generate(prompt, params, images=images)]
        return [t for out in outs for t in out.token_ids], outs[-1].usage

    return asyncio.run(run())


def make_engine(loaded, prefix_cache=True):
    config = EngineConfig(num_tokens=512, block_size=BLOCK, max_num_seqs=4,
                          max_prefill_tokens=16, prefix_cache=prefix_cache, kv_dtype="float32")
    return Engine.from_loaded(loaded, config).start()


def test_engine_greedy_and_caches(checkpoint, loaded, moe_ops):
    # image 0's 12 placeholders [6, 18) straddle the first 16-token prefill chunk
    first = images_for([(128, 96), (96, 64)])
    other = images_for([(128, 96)], seed=7)
    prompt = prompt_with(first)
    engine = make_engine(loaded)
    try:
        assert engine.vision.image_token_id == IDS["image_token_id"]
        assert engine.vision.patch_size == 16 and engine.vision.merge_size == 2
        tokens, usage = generate(engine, prompt, first)
        assert engine.stats()["vision_images_encoded"] == 2
        again, usage_again = generate(engine, prompt, first)   # the same images again
        stats = engine.stats()
        swapped = prompt_with(other + first[1:])                  # same ids, another image
        _, usage_other = generate(engine, swapped, other + first[1:])
    finally:
        engine.shutdown()
    assert tokens == hf_greedy(checkpoint[1], prompt, first)
    assert again == tokens
    assert usage.cached_tokens == 0
    assert usage_again.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    # image 0 encoded once for both chunks; the repeat is served by the prefix cache
    assert stats["vision_images_encoded"] == 2 and stats["vision_encoder_cache_hits"] == 1
    # the first image starts in page 0: nothing before it may be reused with another image
    assert usage_other.cached_tokens == 0


def test_text_prompt_on_vision_model(checkpoint, loaded, moe_ops):
    """A text prompt on a vision model decodes with plain positions (rope delta 0)."""
    prompt = [5, 6, 7, 8, 9, 31, 32, 33, 34, 35]
    engine = make_engine(loaded, prefix_cache=False)
    try:
        engine.warm_up()     # also runs the tower once
        tokens, _ = generate(engine, prompt, ())
    finally:
        engine.shutdown()
    assert tokens == hf_greedy(checkpoint[1], prompt, [])


def test_mismatched_images_are_rejected(loaded, moe_ops):
    images = images_for([(64, 96)])
    prompt = prompt_with(images)
    engine = make_engine(loaded, prefix_cache=False)

    async def submit(p, ims):
        engine.submit(p, SamplingParams(max_tokens=2), images=ims)

    try:
        with pytest.raises(RequestRejected, match="1 image placeholder run.* 0 image"):
            asyncio.run(submit(prompt, ()))
        with pytest.raises(RequestRejected, match="needs 6 placeholder tokens"):
            asyncio.run(submit(prompt[:6] + prompt[7:], images))   # one placeholder short
        with pytest.raises(RequestRejected, match="2 image"):
            asyncio.run(submit(prompt, images * 2))
    finally:
        engine.shutdown()


def test_images_on_a_text_model_are_rejected(tiny_checkpoint_dir):
    loaded = load_model(str(tiny_checkpoint_dir))
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=128, block_size=BLOCK)).start()
    try:
        assert engine.vision is None

        async def submit():
            engine.submit([1, 2, 3], SamplingParams(max_tokens=2), images=images_for([(64, 64)]))

        with pytest.raises(RequestRejected, match="does not take images"):
            asyncio.run(submit())
    finally:
        engine.shutdown()


@pytest.fixture
def tiny_checkpoint_dir(tmp_path):
    from tests.models.helpers import tiny_hf_model

    tiny_hf_model("llama", tmp_path)
    return tmp_path


def test_positions_match_get_rope_index(checkpoint, loaded):
    """Our layout's (t, h, w) positions and decode offset equal transformers' get_rope_index
    for images of different shapes, between and after text."""
    images = images_for([(64, 160), (128, 64), (64, 64)])
    prompt = prompt_with(images, seed=3)
    layout = layout_images(prompt, images, loaded.vision.preprocess)
    inputs = hf_inputs(prompt, images)
    positions, delta = checkpoint[1].model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert np.array_equal(layout.positions.T, positions[:, 0].numpy())
    assert layout.rope_delta == int(delta[0, 0])
    rows: list = []
    chunk = layout.chunk_positions(0, len(prompt) + 2, 1000, rows)
    image = layout.is_image
    assert chunk[len(prompt):] == [len(prompt) + layout.rope_delta + i for i in range(2)]
    assert [chunk[i] for i in np.flatnonzero(image)] == list(range(1000, 1000 + image.sum()))
    assert np.array_equal(np.array(rows), layout.positions[image])


def test_repeated_image_in_a_later_turn_hits(loaded, moe_ops):
    images = images_for([(64, 96)], seed=11)
    prompt = prompt_with(images, seed=5)
    engine = make_engine(loaded)
    try:
        tokens, _ = generate(engine, prompt, images)
        # the next turn: the history (the image in it) and the same image sent again
        follow_up = prompt + tokens + prompt_with(images, seed=6)
        _, usage = generate(engine, follow_up, images * 2)
        stats = engine.stats()
    finally:
        engine.shutdown()
    # the first turn's pages (its image included) are reused up to its last full page, and
    # the image's second copy comes from the encoder cache
    assert usage.cached_tokens >= (len(prompt) - 1) // BLOCK * BLOCK > 0
    assert stats["vision_images_encoded"] == 1 and stats["vision_encoder_cache_hits"] >= 1
