"""The architecture registry and config readers, checked against transformers' configs."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.checkpoint.gguf_config import config_from_gguf
from freetoken.models.checkpoint.hf_config import config_from_hf
from freetoken.models.registry import ARCHITECTURES, spec_for_gguf, supported_names
from freetoken.models.forward.rope import inverse_frequencies
from tests.models.helpers import assert_inverse_frequencies_close


def test_every_supported_name_resolves():
    names = supported_names()
    for arch in ("llama", "qwen2", "qwen3", "mistral", "LlamaForCausalLM",
                 "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in names
    assert set(ARCHITECTURES) == {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe",
                                  "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe", "qwen3_vl",
                                  "qwen3_vl_moe", "gemma3"}
    with pytest.raises(UnsupportedModelError,
                       match="'falcon'.*gemma3, llama, mistral, mixtral, olmoe, qwen2, qwen2_moe, "
                             "qwen3, qwen3_5_moe"):
        spec_for_gguf("falcon", "x.gguf")
    # llama.cpp writes Mixtral as `llama` with experts
    assert spec_for_gguf("llama", "x.gguf", has_experts=True).name == "mixtral"
    assert spec_for_gguf("llama", "x.gguf").name == "llama"
    assert spec_for_gguf("qwen3moe", "x.gguf", has_experts=True).name == "qwen3_moe"


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


def test_every_canonical_part_has_a_name_in_each_format():
    from freetoken.models.registry import (GDN_PARTS, GGUF_LAYER, HF_EXPERTS_STACKED, HF_LAYER,
                                           LAYER_PARTS)

    assert set(GGUF_LAYER) == set(LAYER_PARTS)
    assert set(GDN_PARTS) <= set(HF_LAYER)
    experts = {"experts." + proj for proj in HF_EXPERTS_STACKED}
    assert set(HF_LAYER) | experts == set(LAYER_PARTS)


def test_moe_config_from_transformers_configs():
    """Expert counts, widths, routing and the dense/sparse layer mix as transformers builds
    them (its modules decide which layers are sparse)."""
    import transformers

    cases = [("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
              dict(num_experts=6, moe_intermediate_size=8, shared_expert_intermediate_size=16,
                   decoder_sparse_step=2, mlp_only_layers=[3], num_hidden_layers=6)),
             ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6,
                                                          num_hidden_layers=2))]
    for config_name, model_name, extra in cases:
        hf = getattr(transformers, config_name)(
            vocab_size=32, hidden_size=16, intermediate_size=24, num_attention_heads=2,
            num_key_value_heads=1, num_experts_per_tok=2, **extra)
        model = getattr(transformers, model_name)(hf)
        cfg = config_from_hf({**hf_dict(hf), "architectures": [model_name]}, "c.json")
        sparse = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
        assert cfg.moe.sparse_layers == sparse and cfg.moe.num_experts == 6
        assert cfg.moe.top_k == 2
        assert cfg.num_params == sum(p.numel() for p in model.parameters())
