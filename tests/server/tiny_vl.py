"""A tiny random llama whose tokenizer and chat template know Qwen's image placeholders, and an
engine wrapper with the vision interface (`vision`, `submit(..., images=)`) that records what
the server hands it: the server side of image inputs, tested without a vision tower."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from freetoken.vision.inputs import VisionPreprocess
from tests.models.vl_tokenizer import IMAGE_SPECIALS, write_vl_tokenizer
from tests.vision.images import QWEN35

CONTEXT = 1024


def write_tiny_vl(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = max(write_vl_tokenizer(directory).values()) + 1
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=None,
                         initializer_range=0.3)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab - 1}))


def qwen35_vision(tokenizer) -> VisionPreprocess:
    """Qwen3.5/3.6's preprocessing settings with this tokenizer's placeholder ids."""
    start, end, pad = (tokenizer.token_id(t) for t in IMAGE_SPECIALS)
    return replace(QWEN35, image_token_id=pad, vision_start_token_id=start,
                   vision_end_token_id=end)


class RecordingVisionEngine:
    """A text engine behind the vision interface: `submit` records (prompt ids, images) and
    runs the ids as text (the placeholder ids are ordinary tokens to the tiny llama)."""

    def __init__(self, engine, vision: VisionPreprocess):
        self._engine = engine
        self.vision = vision
        self.calls: list[tuple[list[int], tuple]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, prompt_ids, params, request_id=None, guide=None, images=()):
        self.calls.append((list(prompt_ids), tuple(images)))
        return self._engine.submit(prompt_ids, params, request_id, guide)
