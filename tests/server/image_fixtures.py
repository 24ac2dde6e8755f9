"""Fixtures for the image tests: the tiny VL model served behind the recording vision engine,
and helpers to build image parts and the ids an independent implementation expects."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from tests.server.tiny_vl import CONTEXT, RecordingVisionEngine, qwen35_vision, write_tiny_vl
from tests.vision.images import QWEN35_PREPROCESSOR


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-vl")
    write_tiny_vl(directory)
    return directory


@pytest.fixture(scope="session")
def vl_loaded(vl_dir):
    from freetoken.models.loader import load_model

    return load_model(str(vl_dir), device="cpu")


@pytest.fixture(scope="session")
def vl_engine(vl_loaded):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine

    config = EngineConfig(num_tokens=4 * CONTEXT, block_size=16, max_num_seqs=4,
                          max_prefill_tokens=256, device="cpu")
    engine = Engine.from_loaded(vl_loaded, config).start()
    yield RecordingVisionEngine(engine, qwen35_vision(vl_loaded.tokenizer))
    engine.shutdown()


def serve_vl(engine, loaded, **options):
    from freetoken.server.app import create_app
    from freetoken.server.launch import ServerThread

    app = create_app(engine, loaded.tokenizer, loaded.name, **options)
    return ServerThread(app, "127.0.0.1", 0).start()


@pytest.fixture(scope="module")
def vl_url(vl_engine, vl_loaded):
    thread = serve_vl(vl_engine, vl_loaded)
    yield thread.url
    thread.stop()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def hf_expected(vl_dir, messages: list[dict], images: list[bytes], max_pixels=16777216):
    """(prompt ids, [(pixel_values, grid)]) as transformers makes them: its tokenizer renders
    the template, its image processor preprocesses, and each placeholder is repeated in the
    text before tokenizing (as Qwen3VLProcessor does)."""
    import io

    import numpy as np
    from PIL import Image, ImageOps
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    settings = {k: v for k, v in QWEN35_PREPROCESSOR.items() if k != "image_processor_type"}
    processor = Qwen2VLImageProcessorPil(**{**settings, "size": {
        "shortest_edge": settings["size"]["shortest_edge"], "longest_edge": max_pixels}})
    processed = []
    for data in images:
        out = processor(images=[ImageOps.exif_transpose(Image.open(io.BytesIO(data)))],
                        return_tensors="np")
        processed.append((np.asarray(out["pixel_values"]),
                          tuple(int(x) for x in out["image_grid_thw"][0])))
    tokenizer = AutoTokenizer.from_pretrained(str(vl_dir))
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(images) + 1
    expanded = pieces[0]
    for (_, grid), piece in zip(processed, pieces[1:]):
        expanded += "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // 4) + piece
    return tokenizer(expanded, add_special_tokens=False)["input_ids"], processed
