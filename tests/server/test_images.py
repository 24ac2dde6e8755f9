"""Images through the OpenAI and Anthropic APIs, with the official clients, into the engine:
the prompt ids it receives (each placeholder expanded to the image's tokens) and the
preprocessed images, against transformers' tokenizer, template and image processor."""

from __future__ import annotations

import hashlib

import anthropic
import numpy as np
import openai
import pytest

from tests.server.image_fixtures import (b64, data_url, hf_expected, serve_vl, vl_dir,  # noqa: F401
                                         vl_engine, vl_loaded, vl_url)
from tests.vision.images import encode, random_image, solid_png

RED = solid_png(256, 256, (255, 0, 0))            # the deployment check's image: 64 tokens
WIDE = encode(random_image(320, 200, "RGB", seed=5), "JPEG")   # scaled up to 224 x 352: 77


@pytest.fixture(scope="module")
def oai(vl_url):
    return openai.OpenAI(base_url=vl_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(vl_url):
    return anthropic.Anthropic(base_url=vl_url, api_key="unused", max_retries=0, timeout=300)


def check_received(engine, vl_dir, messages, images, max_pixels=16777216):
    """The engine's last call holds transformers' prompt ids and preprocessed images."""
    ids, received = engine.calls[-1]
    expected_ids, expected = hf_expected(vl_dir, messages, images, max_pixels)
    assert ids == expected_ids
    assert len(received) == len(images)
    for image, data, (pixels, grid) in zip(received, images, expected):
        assert image.grid_thw == grid
        np.testing.assert_array_equal(image.pixel_values, pixels)   # same ops: exact
        assert image.digest == hashlib.sha256(data).hexdigest()
    return ids


def test_openai_deployment_check_red_square(oai, vl_engine, vl_dir, vl_loaded):
    reply = oai.chat.completions.create(model=vl_loaded.name, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(RED), "detail": "auto"}},
        {"type": "text", "text": "What colour is this image?"}]}])
    ids = check_received(vl_engine, vl_dir, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is this image?"}]}], [RED])
    image = vl_engine.calls[-1][1][0]
    assert image.grid_thw == (1, 16, 16) and image.pixel_values.shape == (256, 1536)
    assert ids.count(vl_engine.vision.image_token_id) == 64
    assert reply.usage.prompt_tokens == len(ids)     # image tokens are prompt tokens


def test_openai_two_images_keep_their_order_and_sizes(oai, vl_engine, vl_dir, vl_loaded):
    parts = [{"type": "text", "text": "First:"},
             {"type": "image_url", "image_url": {"url": data_url(WIDE, "image/jpeg")}},
             {"type": "text", "text": "second:"},
             {"type": "image_url", "image_url": {"url": data_url(RED)}},
             {"type": "text", "text": "same?"}]
    reply = oai.chat.completions.create(
        model=vl_loaded.name, max_tokens=3, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    template_parts = [{"type": "text", "text": "First:"}, {"type": "image"},
                      {"type": "text", "text": "second:"}, {"type": "image"},
                      {"type": "text", "text": "same?"}]
    ids = check_received(vl_engine, vl_dir, [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": template_parts}],
                         [WIDE, RED])
    grids = [image.grid_thw for image in vl_engine.calls[-1][1]]
    assert grids == [(1, 14, 22), (1, 16, 16)]
    assert ids.count(vl_engine.vision.image_token_id) == 77 + 64
    assert reply.usage.prompt_tokens == len(ids)


def test_openai_stream_with_an_image(oai, vl_engine, vl_loaded):
    chunks = list(oai.chat.completions.create(
        model=vl_loaded.name, max_tokens=3, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]))
    assert chunks[-1].usage.prompt_tokens == len(vl_engine.calls[-1][0])
    assert len(vl_engine.calls[-1][1]) == 1


def test_anthropic_image_block(claude, vl_engine, vl_dir, vl_loaded):
    content = [{"type": "text", "text": "Describe"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                            "data": b64(WIDE)}}]
    reply = claude.messages.create(model=vl_loaded.name, max_tokens=3,
                                   messages=[{"role": "user", "content": content}])
    ids = check_received(vl_engine, vl_dir, [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image"}]}], [WIDE])
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ids)
    counted = claude.messages.count_tokens(model=vl_loaded.name,
                                           messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == len(ids)


def test_anthropic_stream_with_an_image(claude, vl_engine, vl_loaded):
    with claude.messages.stream(model=vl_loaded.name, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": b64(RED)}}]}]) as stream:
        final = stream.get_final_message()
    ids = vl_engine.calls[-1][0]
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)
    assert ids.count(vl_engine.vision.image_token_id) == 64


def test_text_only_request_on_a_vision_model_is_unchanged(oai, vl_engine, vl_dir, vl_loaded):
    oai.chat.completions.create(model=vl_loaded.name, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]}])
    ids, images = vl_engine.calls[-1]
    assert images == ()
    assert ids == vl_loaded.tokenizer.encode(
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n")


def test_detail_low_caps_the_image_at_512_by_512(oai, vl_engine, vl_loaded):
    big = encode(random_image(1024, 768, "RGB", seed=9), "PNG")
    for detail, pixels in (("low", 512 * 512), ("high", 1024 * 768)):
        oai.chat.completions.create(model=vl_loaded.name, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": data_url(big), "detail": detail}}]}])
        _, h, w = vl_engine.calls[-1][1][0].grid_thw
        assert h * w * 256 <= pixels and h * w * 256 > pixels * 0.8


def test_max_image_pixels_flag(vl_engine, vl_dir, vl_loaded):
    """--max-image-pixels 100000: resized as transformers' processor with that longest_edge."""
    image = encode(random_image(640, 480, "RGB", seed=4), "PNG")
    thread = serve_vl(vl_engine, vl_loaded, max_image_pixels=100_000)
    try:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="-", max_retries=0)
        client.chat.completions.create(model=vl_loaded.name, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": data_url(image)}}]}])
    finally:
        thread.stop()
    check_received(vl_engine, vl_dir, [{"role": "user", "content": [{"type": "image"}]}],
                   [image], max_pixels=100_000)
    _, h, w = vl_engine.calls[-1][1][0].grid_thw
    assert h * w * 256 <= 100_000


def test_anthropic_tool_result_with_a_screenshot(claude, vl_engine, vl_dir, vl_loaded):
    """Images in a tool_result and beside it in the same user message reach the engine in the
    order the template renders them: the tool turn first, whatever the block order."""
    shot = encode(random_image(300, 260, "RGB", seed=11), "PNG")
    claude.messages.create(model=vl_loaded.name, max_tokens=2, messages=[
        {"role": "user", "content": "Take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot",
                                           "input": {}}]},
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(RED)}},
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "Here:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64(shot)}}]},
            {"type": "text", "text": "Same?"}]}])
    check_received(vl_engine, vl_dir, [
        {"role": "user", "content": "Take a screenshot"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "shot", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "Here:"},
                                                           {"type": "image"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Same?"}]}],
        [shot, RED])
