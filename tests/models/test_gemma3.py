"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on tiny random checkpoints: sliding
layers (window 8, shorter than the prompts) interleaved with global ones, the two rope bases,
q/k norms, the four norms per layer, the scaled embedding, GELU-tanh, query_pre_attn_scalar
and a final logit soft-cap; every step of a chunked prefill + decode over paged KV."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close, tiny_hf_model
from tests.models.test_dense_hf import hf_last_logits, prompts, run_and_compare
from tests.tolerances import bound

# 4 layers: sliding, sliding, global, sliding; a query scale that is not head_dim ** -0.5
GEMMA3 = dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}})


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    return directory, tiny_hf_model("gemma3", directory, **GEMMA3)


def test_config_reads_the_layer_pattern_and_both_rope_bases(gemma3):
    directory, _ = gemma3
    cfg = load_model(str(directory), device="cpu").config
    assert cfg.architecture == "gemma3"
    assert [cfg.window(i) for i in range(4)] == [8, 8, 0, 8]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    assert cfg.embed_scale == pytest.approx(64 ** 0.5)
    assert cfg.activation == "gelu_tanh" and cfg.block_out_norms and cfg.qk_norm == "head"


def test_forward_matches_transformers(gemma3):
    directory, hf = gemma3
    loaded = load_model(str(directory), device="cpu")
    run_and_compare(loaded.model, hf)


def test_float16_kv_pool_stays_close_to_transformers(gemma3):
    directory, hf = gemma3
    run_and_compare(load_model(str(directory), device="cpu").model, hf, kv_dtype="float16")


def test_window_and_local_rope_change_the_logits(gemma3):
    """The windowed, locally-rotated layers matter: transformers without them differs far
    beyond float32 rounding, so the match above cannot come from full attention."""
    directory, hf = gemma3
    loaded = load_model(str(directory), device="cpu")
    a, _ = prompts(loaded.config.vocab_size)
    windowed = hf_last_logits(hf, a)
    hf.config.sliding_window = 10_000
    try:
        for layer in hf.model.layers:
            layer.self_attn.sliding_window = None
        full = hf_last_logits(hf, a)
    finally:
        hf.config.sliding_window = 8
        for layer, kind in zip(hf.model.layers, GEMMA3["layer_types"]):
            layer.self_attn.sliding_window = 8 if kind == "sliding_attention" else None
    cfg = loaded.config
    rounding = bound(torch.float32, windowed.abs().max(),
                     (cfg.hidden_size + cfg.intermediate_size) * cfg.num_layers)
    assert (windowed - full).abs().max() > 100 * rounding
    assert_logits_close(PagedRunner(loaded.model).step([(0, a)])[0], windowed, cfg)


def test_final_logit_softcap(tmp_path):
    hf = tiny_hf_model("gemma3", tmp_path, seed=2, final_logit_softcapping=3.0, **GEMMA3)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.config.final_logit_softcap == 3.0
    a, _ = prompts(loaded.config.vocab_size)
    logits = PagedRunner(loaded.model).step([(0, a)])[0]
    assert torch.as_tensor(logits).abs().max() < 3.0
    assert_logits_close(logits, hf_last_logits(hf, a), loaded.config)


def test_unsupported_gemma_settings_are_refused(tmp_path):
    import json

    from freetoken.models.errors import UnsupportedModelError

    tiny_hf_model("gemma3", tmp_path, seed=1, **GEMMA3)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value, match in (("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
                              ("hidden_activation", "relu", "hidden_activation 'relu'")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(UnsupportedModelError, match=match):
            load_model(str(tmp_path), device="cpu")
