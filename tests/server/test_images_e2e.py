"""Images end to end with nothing stood in: a tiny random folder of each vision architecture
(Qwen3_5MoeForConditionalGeneration, Qwen3VLForConditionalGeneration and
Qwen3VLMoeForConditionalGeneration; Qwen's placeholder tokens, a template that renders image
items, Qwen3.5's preprocessor_config.json) loaded and served by the real engine and app,
asked with the official `openai` and `anthropic` clients the deployment check (a 256x256
solid-red PNG, "What colour is this image?"), against transformers' own processor and
`generate` on the same folder."""

from __future__ import annotations

import io

import anthropic
import openai
import pytest
import torch

from tests.models.vision_checkpoint import ARCHES, build_served_vision_model
from tests.server.image_fixtures import b64, data_url
from tests.vision.images import solid_png

RED = solid_png(256, 256, (255, 0, 0))       # the deployment check: 16x16 patches, 64 tokens
QUESTION = "What colour is this image?"
NEW_TOKENS = 8
BLOCK = 16


@pytest.fixture(scope="module", params=ARCHES)
def folder(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp(f"tiny-{request.param}-served")
    # seeds whose greedy answer to the deployment check is not an immediate <|im_end|>
    seed = {"qwen3_vl_moe": 6}.get(request.param, 3)
    build_served_vision_model(directory, seed=seed, arch=request.param)
    return directory


@pytest.fixture(scope="module")
def served(folder):
    """The folder behind the real engine (float32, KV in float32 as the reference computes;
    prefill chunks of 48 tokens, so the image is cut across steps) and the real app."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    loaded = load_model(str(folder), device="cpu")
    config = EngineConfig(num_tokens=2048, block_size=BLOCK, max_num_seqs=4,
                          max_prefill_tokens=48, device="cpu", kv_dtype="float32")
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    thread = ServerThread(create_app(engine, loaded.tokenizer, loaded.name),
                          "127.0.0.1", 0).start()
    yield thread.url, engine, loaded.name
    thread.stop()
    engine.shutdown()


class Reference:
    """transformers on the same folder: its tokenizer renders the template, its Qwen3-VL
    processor expands each image placeholder and makes pixel_values, its model generates
    greedily in float64."""

    def __init__(self, folder):
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        class ImageOnlyProcessor(Qwen3VLProcessor):
            # NOTE: the video processor needs torchvision, which images never use.
            def check_argument_for_proper_class(self, name, argument):
                if name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(name, argument)

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.processor = ImageOnlyProcessor(AutoImageProcessor.from_pretrained(str(folder)),
                                            self.tokenizer, None,
                                            chat_template=self.tokenizer.chat_template)
        self.model = AutoModelForImageTextToText.from_pretrained(
            str(folder), dtype=torch.float64).eval()
        if self.model.config.model_type != "qwen3_vl":     # routed experts
            self.model.model.language_model.set_experts_implementation("eager")
        self.eos = self.model.generation_config.eos_token_id

    def generate(self, png: bytes, question: str = QUESTION) -> tuple[list[int], list[int]]:
        """(prompt ids, greedy completion ids without the final eos)."""
        from PIL import Image

        messages = [{"role": "user", "content": [
            {"type": "image", "image": Image.open(io.BytesIO(png))},
            {"type": "text", "text": question}]}]
        inputs = self.processor.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True,
            return_tensors="pt")
        inputs["pixel_values"] = inputs["pixel_values"].double()
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True)
        prompt = inputs["input_ids"][0].tolist()
        tokens = out.sequences[0, len(prompt):].tolist()
        check_margins(out.scores)
        if tokens and tokens[-1] == self.eos:
            tokens = tokens[:-1]
        return prompt, tokens

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_margins(scores) -> None:
    """Greedy choices the float32 engine must reproduce: the best logit leads the next by far
    more than float32 rounding through this model moves it (~1e-5 relative)."""
    for step, row in enumerate(scores):
        top = torch.topk(row[0], 2).values
        gap, scale = (top[0] - top[1]).item(), row[0].abs().max().item()
        assert gap > 1e-3 * max(scale, 1.0), f"near tie at step {step}: {gap} of {scale}"


@pytest.fixture(scope="module")
def reference(folder):
    return Reference(folder)


def oai_client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def claude_client(url):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


def ask_openai(url, name, png, **extra):
    return oai_client(url).chat.completions.create(
        model=name, max_tokens=NEW_TOKENS, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(png)}},
            {"type": "text", "text": QUESTION}]}], **extra)


def ask_anthropic(url, name, png):
    return claude_client(url).messages.create(
        model=name, max_tokens=NEW_TOKENS, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": b64(png)}},
            {"type": "text", "text": QUESTION}]}])


def test_openai_red_square_matches_transformers(served, reference, moe_ops):
    url, engine, name = served
    prompt, expected = reference.generate(RED)
    assert prompt.count(engine.vision.image_token_id) == 64
    reply = ask_openai(url, name, RED, logprobs=True)
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert tokens == [reference.tokenizer.decode([t]) for t in expected]
    assert reply.choices[0].message.content == reference.text(expected)
    assert reply.usage.prompt_tokens == len(prompt)       # the image's 64 tokens included
    assert reply.usage.completion_tokens == len(expected)


def test_anthropic_red_square_matches_transformers(served, reference, moe_ops):
    url, engine, name = served
    prompt, expected = reference.generate(RED)
    reply = ask_anthropic(url, name, RED)
    assert reply.content[0].text == reference.text(expected)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt)
    assert reply.usage.output_tokens == len(expected)


def test_a_repeated_image_is_cached_and_another_is_not(served, reference, moe_ops):
    url, engine, name = served
    green, blue = solid_png(256, 256, (0, 160, 60)), solid_png(256, 256, (20, 40, 200))
    first = ask_openai(url, name, green)
    encoded = engine.stats()["vision_images_encoded"]
    again = ask_openai(url, name, green)
    other = ask_anthropic(url, name, blue)
    prompt, expected = reference.generate(blue)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full page but the one holding the last prompt token
    full_pages = (first.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert again.usage.prompt_tokens_details.cached_tokens == full_pages
    assert again.choices[0].message.content == first.choices[0].message.content
    # the other image's pages miss from its first placeholder on: "<|im_start|>user\n" and
    # vision start precede it, less than a page
    assert prompt.index(engine.vision.image_token_id) < BLOCK
    assert other.usage.cache_read_input_tokens == 0
    assert other.usage.input_tokens == len(prompt)
    assert other.content[0].text == reference.text(expected)
    assert engine.stats()["vision_images_encoded"] == encoded + 1   # blue only


def test_completions_refuse_image_placeholders_without_images(served, moe_ops):
    import httpx

    url, engine, name = served
    pad = engine.vision.image_token_id
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
    for prompt in (text, [5, 6, engine.vision.vision_start_token_id, pad, pad,
                          engine.vision.vision_end_token_id]):
        reply = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "prompt" and "<|image_pad|>" in error["message"]
        assert f"token {pad}" in error["message"]
    # the frame tokens alone are text; the engine keeps serving
    fine = oai_client(url).completions.create(model=name, max_tokens=2, temperature=0,
                                              prompt="<|vision_start|>Hi<|vision_end|>")
    assert fine.usage.completion_tokens == 2


def test_ft_serve_answers_the_deployment_check(folder, reference):
    """The same through `ft serve` itself: the start-up memory plan with the tower, the
    image flags, the official client."""
    import os
    import re
    import subprocess
    import sys

    command = [sys.executable, "-c", "from freetoken.cli.main import main; main()", "serve",
               "--model", str(folder), "--port", "0", "--device", "cpu", "--num-tokens",
               "2048", "--kv-dtype", "float32", "--max-image-pixels", str(512 * 512),
               "--log-level", "warning"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "FreeToken serving" in line:
                break
        match = re.search(r"at (http://\S+)", lines[-1])
        assert match, "".join(lines)
        prompt, expected = reference.generate(RED)
        reply = ask_openai(match.group(1), folder.name, RED)
        assert reply.choices[0].message.content == reference.text(expected)
        assert reply.usage.prompt_tokens == len(prompt)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
