"""Fixtures shared by the engine tests."""

import pytest
import torch

from tests.engine.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, our loaded model, three prompts) on one tiny random llama."""
    from freetoken.models.loader import load_model
    from transformers import LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama-sampling")
    write_tiny_llama(directory)
    hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded = load_model(str(directory), device="cpu")
    prompts = [loaded.tokenizer.encode(f"Story {i}: the fox and the dog " * 2) for i in range(3)]
    return hf, loaded, prompts
