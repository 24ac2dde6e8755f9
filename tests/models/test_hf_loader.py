"""HF directory details: sharded safetensors, generation_config.json, chat_template.jinja."""

from __future__ import annotations

import json
import shutil

import torch

from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.models.test_dense_hf import hf_last_logits, prompts


def test_sharded_checkpoint_loads_through_the_index(tiny_checkpoint, tmp_path):
    directory, hf = tiny_checkpoint("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path))
    a, _ = prompts(loaded.config.vocab_size)
    logits = PagedRunner(loaded.model).step([(0, a)])[0]
    assert_logits_close(logits, hf_last_logits(hf, a), loaded.config)


def test_generation_defaults_and_template_file(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    copy = shutil.copytree(directory, tmp_path / "model")
    (copy / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
         "max_new_tokens": 100, "repetition_penalty": 1.1, "eos_token_id": [2, 1]}))
    (copy / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    loaded = load_model(str(copy))
    defaults = loaded.generation_defaults
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == \
        (0.6, 20, 0.95, 100)
    assert defaults.extra["repetition_penalty"] == 1.1
    assert loaded.tokenizer.eos_token_ids[:2] == (2, 1)
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    assert loaded.name == "model" and loaded.source == str(copy)


def test_greedy_generation_config_means_temperature_zero(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    copy = shutil.copytree(directory, tmp_path / "model")
    (copy / "generation_config.json").write_text(json.dumps({"do_sample": False,
                                                             "temperature": 0.7}))
    assert load_model(str(copy)).generation_defaults.temperature == 0.0
