"""The architecture registry and config readers, checked against transformers' configs."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.registry import (ARCHITECTURES, config_from_gguf, config_from_hf,
                                       spec_for_gguf, supported_names)
from freetoken.models.rope import inverse_frequencies
from tests.models.helpers import assert_inverse_frequencies_close


def test_every_supported_name_resolves():
    names = supported_names()
    for arch in ("llama", "qwen2", "qwen3", "mistral", "LlamaForCausalLM",
                 "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in names
    assert set(ARCHITECTURES) == {"llama", "qwen2", "qwen3", "mistral"}
    with pytest.raises(UnsupportedModelError, match="'falcon'.*llama, mistral, qwen2, qwen3"):
        spec_for_gguf("falcon", "x.gguf")


def hf_dict(config) -> dict:
    return config.to_dict()


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64,
                     max_position_embeddings=131072, rope_parameters=scaling)
    ours = config_from_hf({**hf_dict(hf), "architectures": ["LlamaForCausalLM"]}, "c.json")
    assert ours.rope_scaling["rope_type"] == "llama3" and ours.rope_theta == 500000.0
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    assert_inverse_frequencies_close(inverse_frequencies(ours), expected)


def test_linear_rope_scaling_and_legacy_keys():
    legacy = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "vocab_size": 10,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    cfg = config_from_hf(legacy, "c.json")
    assert cfg.rope_theta == 1000.0 and cfg.num_kv_heads == 4 and cfg.head_dim == 16
    base = 1.0 / 1000.0 ** (torch.arange(0, 16, 2).float() / 16)
    assert_inverse_frequencies_close(inverse_frequencies(cfg), base / 2.0)


def test_mixed_sliding_layers_are_refused():
    from transformers import Qwen2Config

    hf = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                     max_window_layers=1)
    raw = {**hf_dict(hf), "architectures": ["Qwen2ForCausalLM"]}
    if len(set(raw["layer_types"])) == 1:
        raw["layer_types"] = ["full_attention", "sliding_attention"]
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        config_from_hf(raw, "c.json")


def test_hf_reader_names_missing_keys():
    with pytest.raises(ModelFormatError, match="'hidden_size'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"]}, "c.json")


def test_gguf_reader_names_missing_keys():
    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64}
    with pytest.raises(ModelFormatError, match="'qwen3.attention.head_count'"):
        config_from_gguf(meta, 10, "m.gguf")
