"""YaRN rope scaling against transformers: frequencies, attention factor, and full forwards.

The tiny checkpoints pretrain on 64 positions (original_max_position_embeddings) and run
sequences past 80, so the stretched part of the rotary table is what the logits depend on.
"""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from freetoken.models.config import ModelConfig
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.loader import load_model
from freetoken.models.checkpoint.gguf_config import config_from_gguf
from freetoken.models.checkpoint.hf_config import config_from_hf
from freetoken.models.forward.rope import attention_factor, cos_sin_cache, inverse_frequencies
from tests.models.helpers import (PagedRunner, assert_inverse_frequencies_close,
                                  assert_logits_close, tiny_hf_model)
from tests.tolerances import assert_close, eps

ORIGINAL = 64      # pretraining context of the tiny checkpoints

# (HF config class, shape, rope_parameters)
CASES = {
    "qwen2.5": ("Qwen2Config", dict(hidden_size=3584, num_attention_heads=28,
                                    max_position_embeddings=32768),
                {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                 "original_max_position_embeddings": 32768}),
    "mscale": ("LlamaConfig", dict(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                   max_position_embeddings=163840),
               {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                "original_max_position_embeddings": 4096, "mscale": 1.0,
                "mscale_all_dim": 0.707}),
    "attention_factor": ("Qwen3Config", dict(hidden_size=1024, num_attention_heads=16,
                                             head_dim=128, max_position_embeddings=32768),
                         {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0,
                          "original_max_position_embeddings": 4096, "attention_factor": 0.9}),
    "betas_untruncated": ("LlamaConfig", dict(hidden_size=512, num_attention_heads=8,
                                              max_position_embeddings=5120),
                          {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 2.5,
                           "original_max_position_embeddings": 2048, "beta_fast": 16.0,
                           "beta_slow": 2.0, "truncate": False}),
}


def hf_config(case: str):
    import transformers

    cls_name, shape, params = CASES[case]
    return getattr(transformers, cls_name)(rope_parameters=dict(params), **shape)


def ours_from(hf) -> ModelConfig:
    arch = type(hf).__name__.replace("Config", "ForCausalLM")
    return config_from_hf({**hf.to_dict(), "architectures": [arch]}, "config.json")


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_match_transformers(case):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config(case)
    ours = ours_from(hf)
    assert ours.rope_scaling["rope_type"] == "yarn"
    expected, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    assert_inverse_frequencies_close(inverse_frequencies(ours), expected)
    assert attention_factor(ours) == pytest.approx(expected_factor, rel=8 * eps(torch.float64))
    assert attention_factor(ours) != 1.0


def test_qwen25_context_is_stretched_by_factor():
    """Qwen2.5's card adds yarn to a config whose max_position_embeddings stays 32768."""
    assert ours_from(hf_config("qwen2.5")).max_position == 4 * 32768
    assert ours_from(hf_config("mscale")).max_position == 163840


def test_cos_sin_table_matches_transformers_rotary_embedding():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                      "factor": 4.0, "original_max_position_embeddings": 128})
    table = torch.from_numpy(cos_sin_cache(ours_from(hf)))
    assert table.shape == (512, 64)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions)
    # transformers rounds each angle position * inv_freq in float32, so cos/sin inherit
    # eps * |angle| (times the attention factor that scales the table): 1.7e-5 at position 412.
    inv_freq = torch.from_numpy(inverse_frequencies(ours_from(hf))).double()
    scale = attention_factor(ours_from(hf))
    angle = positions[0, :, None].double() * inv_freq[None, :] * scale
    assert_close(table[:, :32], cos[0, :, :32], torch.float32, magnitude=angle + scale)
    assert_close(table[:, 32:], sin[0, :, :32], torch.float32, magnitude=angle + scale)


def yarn_checkpoint(arch: str, directory, legacy: bool):
    """A tiny model with yarn on 64 original positions; `legacy` rewrites config.json the
    transformers 4 way (top-level rope_theta, rope_scaling with "type")."""
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": ORIGINAL}
    hf = tiny_hf_model(arch, directory, seed=5, max_position_embeddings=4 * ORIGINAL,
                       rope_parameters=params)
    assert hf.model.rotary_emb.rope_type == "yarn"
    if legacy:
        path = directory / "config.json"
        raw = json.loads(path.read_text())
        raw.pop("rope_parameters")
        raw["rope_theta"] = 10000.0
        raw["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": ORIGINAL}
        path.write_text(json.dumps(raw))
    return hf


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("arch,legacy", [("qwen2", False), ("llama", True)])
def test_forward_past_original_context_matches_transformers(arch, legacy, tmp_path):
    hf = yarn_checkpoint(arch, tmp_path, legacy)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    gen = torch.Generator().manual_seed(2)
    vocab = loaded.config.vocab_size
    a = torch.randint(0, vocab, (ORIGINAL + 6,), generator=gen).tolist()
    b = torch.randint(0, vocab, (13,), generator=gen).tolist()
    runner = PagedRunner(loaded.model, num_blocks=16)
    runner.step([(0, a[:40]), (1, b)])                    # a: first chunk; b: whole prompt
    logits = runner.step([(0, a[40:]), (1, b[-1:])])      # a: second chunk, past 64; b: decode
    b = b + b[-1:]
    for _ in range(6):                                    # decode a to position 76
        for row, seq in ((0, a), (1, b)):
            assert_logits_close(logits[row], hf_last_logits(hf, seq), loaded.config)
        a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
        logits = runner.step([(0, a[-1:]), (1, b[-1:])])
    assert len(a) > ORIGINAL + 10


def gguf_meta(arch: str, **rope: float) -> dict:
    """Minimal GGUF metadata; rope scaling keys named by gguf's own constants."""
    meta = {"general.architecture": arch, f"{arch}.embedding_length": 3584,
            f"{arch}.attention.head_count": 28, f"{arch}.feed_forward_length": 18944,
            f"{arch}.block_count": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.context_length": 32768, f"{arch}.rope.freq_base": 1000000.0,
            gguf.Keys.Rope.SCALING_TYPE.format(arch=arch): "yarn"}
    for name, value in rope.items():
        meta[getattr(gguf.Keys.Rope, name).format(arch=arch)] = value
    return meta


def test_gguf_yarn_keys_give_the_hf_scaling():
    import transformers

    full = {"SCALING_FACTOR": 4.0, "SCALING_ORIG_CTX_LEN": 32768,
            "SCALING_YARN_BETA_FAST": 24.0, "SCALING_YARN_BETA_SLOW": 2.0,
            "SCALING_YARN_ATTN_FACTOR": 1.25, "SCALING_YARN_EXT_FACTOR": 1.0}
    hf = transformers.Qwen2Config(
        hidden_size=3584, num_attention_heads=28, max_position_embeddings=32768,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32768, "beta_fast": 24.0,
                         "beta_slow": 2.0, "attention_factor": 1.25})
    from_hf = ours_from(hf)
    from_gguf = config_from_gguf(gguf_meta("qwen2", **full), 152064, "m.gguf")
    assert from_gguf.rope_scaling == from_hf.rope_scaling
    assert from_gguf.max_position == from_hf.max_position == 4 * 32768
    assert (inverse_frequencies(from_gguf) == inverse_frequencies(from_hf)).all()
    assert attention_factor(from_gguf) == attention_factor(from_hf) == 1.25
    plain = config_from_gguf(gguf_meta("qwen2", SCALING_FACTOR=4.0, SCALING_ORIG_CTX_LEN=32768),
                             152064, "m.gguf")
    assert plain.rope_scaling == ours_from(hf_config("qwen2.5")).rope_scaling


def test_yarn_without_factor_is_refused_naming_the_key():
    raw = {**hf_config("qwen2.5").to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    del raw["rope_parameters"]["factor"]
    with pytest.raises(ModelFormatError, match=r"config\.json.*'factor'"):
        config_from_hf(raw, "config.json")
    legacy = {**raw, "rope_parameters": None, "rope_theta": 1e6,
              "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelFormatError, match="'original_max_position_embeddings'"):
        config_from_hf(legacy, "config.json")
    with pytest.raises(ModelFormatError, match=r"'qwen2\.rope\.scaling\.factor'"):
        config_from_gguf(gguf_meta("qwen2", SCALING_ORIG_CTX_LEN=32768), 10, "m.gguf")
    with pytest.raises(ModelFormatError, match="'qwen2.rope.scaling.original_context_length'"):
        config_from_gguf(gguf_meta("qwen2", SCALING_FACTOR=4.0), 10, "m.gguf")


def test_gguf_yarn_settings_transformers_cannot_express_are_refused():
    meta = gguf_meta("qwen2", SCALING_FACTOR=4.0, SCALING_ORIG_CTX_LEN=32768,
                     SCALING_YARN_LOG_MUL=0.0707)
    with pytest.raises(UnsupportedModelError, match="yarn_log_multiplier"):
        config_from_gguf(meta, 10, "m.gguf")
