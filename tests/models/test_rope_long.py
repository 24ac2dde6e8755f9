"""Rotary cos/sin tables at long positions (up to 131071) against transformers' rotary
embedding modules, for every rope variant the loader supports.

The reference is a float64 evaluation of transformers' own float32 inverse frequencies (the
module's `inv_freq` buffer) and its `attention_scaling`, not transformers' float32 cos/sin:
transformers rounds each angle position * inv_freq to float32, which at 131071 is already off
by up to |angle| * 2^-24 ~ 0.008 rad. FreeToken's `cos_sin_cache` also forms the angle in float32
(np.outer of float32 positions and float32 frequencies) and takes a float32 cos/sin, so its error
against the float64 reference is derived, per entry, from the angle:

  * table construction: one float32 rounding of the angle, <= |angle| * 2^-24, plus the float32
    cos/sin and the attention-factor product, a few 2^-24 of a value <= scale. Checked against
    FreeToken's own frequencies with |angle| * 2^-23 + 1e-6 (times the attention factor).
  * frequencies: both sides compute base ** (-2i / d) with a float32 pow and a float32
    reciprocal (plus a float32 blend for llama3 / yarn), each within ~1.5 ulp of the exact
    value, and they round differently: up to 2 ulp apart (measured), i.e. relative FREQ_REL =
    2^-22. A frequency mismatch is multiplied by the position, so it adds |angle| * FREQ_REL.
    Against transformers the bound is therefore |angle| * (2^-23 + 2^-22) + 1e-6 (times the
    attention factor). A real bug (a wrong exponent, factor, ramp or band edge) changes some
    frequency by far more than 1e-6 relative, i.e. > 0.1 rad at these positions.

No weights, no forward passes: configs are built with transformers' config classes and turned
into FreeToken's ModelConfig by `config_from_hf`, as the loader does for config.json.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from freetoken.models.checkpoint.hf_config import config_from_hf
from freetoken.models.checkpoint.vision_config import vision_config_from_hf
from freetoken.models.config import ModelConfig
from freetoken.models.errors import UnsupportedModelError
from freetoken.models.forward.mrope import MRopeRows
from freetoken.models.forward.rope import (SUPPORTED_ROPE_TYPES, attention_factor, cos_sin_cache,
                                           inverse_frequencies)

U32 = 2.0 ** -24            # float32 unit roundoff
FREQ_REL = 4 * U32          # two float32 frequency computations: up to 2 ulp apart
LONG = 131072

POSITIONS = np.unique(np.concatenate([
    [0, 1, 4095, 32767, 32768, 65535, 100000, 131071],
    np.random.default_rng(1234).integers(0, LONG, size=6)])).astype(np.int64)

LLAMA3 = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
              max_position_embeddings=LONG)

# name: (transformers config class, config kwargs, rope_parameters)
CASES = {
    # Qwen3-8B-like: head_dim 128, theta 1e6, no scaling
    "default": ("Qwen3Config", dict(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                    max_position_embeddings=LONG),
                {"rope_type": "default", "rope_theta": 1000000.0}),
    "linear": ("LlamaConfig", LLAMA3,
               {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # Llama-3.1's rope_scaling
    "llama3": ("LlamaConfig", LLAMA3,
               {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}),
    # Qwen3's model-card YaRN: factor 4 over 32768 (max_position_embeddings stays 32768)
    "yarn": ("Qwen3Config", dict(hidden_size=4096, num_attention_heads=32, head_dim=128,
                                 max_position_embeddings=32768),
             {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
              "original_max_position_embeddings": 32768}),
    # DeepSeek-style mscale / mscale_all_dim
    "yarn_mscale": ("LlamaConfig", dict(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                        max_position_embeddings=163840),
                    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 0.707}),
    # Qwen3-Next: head_dim 256, a quarter of it rotated
    "partial": ("Qwen3NextConfig", dict(max_position_embeddings=LONG),
                {"rope_type": "default", "rope_theta": 10000000.0,
                 "partial_rotary_factor": 0.25}),
    "partial_yarn": ("Qwen3NextConfig", dict(max_position_embeddings=32768),
                     {"rope_type": "yarn", "rope_theta": 10000000.0,
                      "partial_rotary_factor": 0.25, "factor": 4.0,
                      "original_max_position_embeddings": 32768}),
}

# Multimodal rope (interleaved mrope_section; transformers' Qwen3-VL / Qwen3.5 text rotary
# modules only implement the interleaved layout). name: (config class, text_config kwargs)
MROPE_CASES = {
    "qwen3_vl": ("Qwen3VLConfig",
                 dict(max_position_embeddings=LONG, head_dim=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                       "mrope_section": [24, 20, 20],
                                       "mrope_interleaved": True})),
    "qwen3_5_moe": ("Qwen3_5MoeConfig",
                    dict(max_position_embeddings=LONG,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25,
                                          "mrope_section": [11, 11, 10],
                                          "mrope_interleaved": True})),
}


def hf_config(case: str):
    import transformers

    cls_name, shape, params = CASES[case]
    return getattr(transformers, cls_name)(rope_parameters=dict(params), **shape)


def ours_from(hf, arch: str | None = None) -> ModelConfig:
    """ModelConfig the way the loader builds it from config.json."""
    arch = arch or type(hf).__name__.replace("Config", "ForCausalLM")
    return config_from_hf({**hf.to_dict(), "architectures": [arch]}, "config.json")


def rotary_module(config, suffix: str = "RotaryEmbedding"):
    """transformers' rotary embedding module of the config's architecture."""
    modeling = importlib.import_module(type(config).__module__.replace("configuration_",
                                                                       "modeling_"))
    return getattr(modeling, type(config).__name__.replace("Config", suffix))(config)


def reference(inv_freq, scale: float, positions: np.ndarray):
    """float64 (angle, cos, sin) [P, rot/2] for float32 frequencies, times `scale`."""
    angle = positions[:, None].astype(np.float64) * np.asarray(inv_freq, np.float64)[None, :]
    return angle, scale * np.cos(angle), scale * np.sin(angle)


def assert_within(actual, expected, limit, what: str) -> None:
    err = np.abs(np.asarray(actual, np.float64) - expected)
    over = err > limit
    if over.any():
        i = np.unravel_index(np.argmax(err / limit), err.shape)
        raise AssertionError(f"{what}: {int(over.sum())} of {err.size} entries over the bound; "
                             f"worst at (position row {i[0]}, freq {i[1]}): |diff| {err[i]:.3g} > "
                             f"{limit[i]:.3g} ({err[i] / limit[i]:.2f}x)")


def check_rows(rows: np.ndarray, inv_freq, scale: float, positions, freq_rel: float, what: str):
    """rows: float32 [P, rot] = cat(cos, sin) vs the float64 reference of `inv_freq`; bound
    scale * (|angle| * (2^-23 + freq_rel) + 1e-6) (see the module docstring)."""
    half = rows.shape[1] // 2
    angle, cos, sin = reference(inv_freq, scale, positions)
    assert rows.shape == (len(positions), 2 * half) and angle.shape[1] == half
    limit = scale * (np.abs(angle) * (2 * U32 + freq_rel) + 1e-6)
    assert_within(rows[:, :half], cos, limit, f"{what} cos")
    assert_within(rows[:, half:], sin, limit, f"{what} sin")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    hf = hf_config(request.param)
    ours = ours_from(hf)
    module = rotary_module(hf)
    return request.param, hf, ours, module, cos_sin_cache(ours)


def test_loader_keeps_the_rope_settings(case):
    name, hf, ours, module, table = case
    params = CASES[name][2]
    kind = params["rope_type"]
    assert (ours.rope_scaling or {}).get("rope_type", "default") == kind
    assert kind in SUPPORTED_ROPE_TYPES
    assert ours.rope_theta == params["rope_theta"]
    head_dim = hf.head_dim or hf.hidden_size // hf.num_attention_heads
    assert ours.rope_dim == int(head_dim * params.get("partial_rotary_factor", 1.0))
    assert table.shape == (ours.max_position, ours.rope_dim)
    assert ours.max_position >= LONG


def test_frequencies_and_attention_factor_match_transformers(case):
    """Angles of both sides' float32 frequencies, evaluated in float64, agree to FREQ_REL
    (2^-22 ~ 2.4e-7 relative) at every sampled position; the attention factor (YaRN mscale)
    equals transformers' attention_scaling."""
    name, hf, ours, module, table = case
    theirs = module.inv_freq.double().numpy()
    mine = inverse_frequencies(ours).astype(np.float64)
    assert mine.shape == theirs.shape == (ours.rope_dim // 2,)
    ours_angle = reference(mine, 1.0, POSITIONS)[0]
    hf_angle = reference(theirs, 1.0, POSITIONS)[0]
    assert_within(ours_angle, hf_angle, np.abs(hf_angle) * FREQ_REL + 1e-300,
                  f"{name} float64 angles")
    assert attention_factor(ours) == pytest.approx(module.attention_scaling, rel=2.0 ** -50)
    if CASES[name][2]["rope_type"] == "yarn":
        assert attention_factor(ours) != 1.0


def test_table_matches_its_own_frequencies(case):
    """Table construction alone: one float32 rounding of the angle, bound |angle| * 2^-23."""
    name, hf, ours, module, table = case
    rows = np.concatenate([POSITIONS, [ours.max_position - 1]])
    check_rows(table[rows], inverse_frequencies(ours), attention_factor(ours), rows, 0.0,
               f"{name} vs own frequencies")


def test_table_matches_transformers_at_long_positions(case):
    name, hf, ours, module, table = case
    check_rows(table[POSITIONS], module.inv_freq.numpy(), module.attention_scaling, POSITIONS,
               FREQ_REL, f"{name} vs transformers (float64)")


def test_table_matches_transformers_module_output(case):
    """The module's own float32 forward (its layout cat(freqs, freqs), its scaling), with one
    more float32 angle rounding on transformers' side: |angle| * 2^-24 added to the bound."""
    name, hf, ours, module, table = case
    with torch.no_grad():
        cos, sin = module(torch.zeros(1, dtype=torch.float32),
                          torch.from_numpy(POSITIONS)[None])
    half = ours.rope_dim // 2
    cos, sin = cos[0].double().numpy(), sin[0].double().numpy()
    assert cos.shape == (len(POSITIONS), 2 * half)
    np.testing.assert_array_equal(cos[:, :half], cos[:, half:])
    rows = np.concatenate([cos[:, :half], sin[:, :half]], axis=1)
    angle = reference(module.inv_freq.numpy(), 1.0, POSITIONS)[0]
    scale = module.attention_scaling
    limit = scale * (np.abs(angle) * (3 * U32 + FREQ_REL) + 2e-6)
    limit = np.concatenate([limit, limit], axis=1)
    assert_within(table[POSITIONS], rows, limit, f"{name} vs transformers float32 output")


# --- multimodal rope ------------------------------------------------------------------------

def mrope_config(case: str):
    import transformers

    cls_name, text = MROPE_CASES[case]
    return getattr(transformers, cls_name)(text_config=dict(text))


def mrope_positions() -> np.ndarray:
    """int64 [P, 3] (t, h, w): text positions (t = h = w) and image-like ones that differ."""
    rng = np.random.default_rng(7)
    text = np.repeat(POSITIONS[:, None], 3, axis=1)
    t = rng.integers(0, LONG, size=8)
    image = np.stack([t, np.minimum(t + rng.integers(0, 64, 8), LONG - 1),
                      np.maximum(t - rng.integers(0, 64, 8), 0)], axis=1)
    image = np.concatenate([image, [[131071, 0, 65535], [0, 131071, 100000]]])
    return np.concatenate([text, image]).astype(np.int64)


@pytest.mark.parametrize("name", sorted(MROPE_CASES))
def test_mrope_rows_match_transformers(name):
    """MRopeRows (image tokens' rows) and the text rows of the table against transformers'
    text rotary module: float64 cos/sin per axis, recombined by the module's own
    `recomposition_frequencies`."""
    hf = mrope_config(name)
    arch = type(hf).__name__.replace("Config", "ForConditionalGeneration")
    raw = {**hf.to_dict(), "architectures": [arch]}
    ours = config_from_hf(raw, "config.json")
    vision = vision_config_from_hf(raw, "config.json")
    text = MROPE_CASES[name][1]["rope_parameters"]
    assert vision.mrope_section == tuple(text["mrope_section"]) and vision.mrope_interleaved
    module = rotary_module(hf.text_config)
    assert ours.rope_dim == 2 * module.inv_freq.shape[0]
    scale = module.attention_scaling
    assert attention_factor(ours) == scale == 1.0

    positions = mrope_positions()                                     # [P, 3]
    inv = module.inv_freq.double()
    angles = torch.from_numpy(positions.T.astype(np.float64))[:, None, :, None] * inv
    cos = module.recomposition_frequencies(angles.cos() * scale)[0, :, :inv.shape[0]].numpy()
    sin = module.recomposition_frequencies(angles.sin() * scale)[0, :, :inv.shape[0]].numpy()
    # the angle each entry actually uses: the axis its frequency follows
    chosen = module.recomposition_frequencies(angles.clone())[0, :, :inv.shape[0]].numpy()
    limit = scale * (np.abs(chosen) * (2 * U32 + FREQ_REL) + 1e-6)

    rows = MRopeRows(ours, vision.mrope_section, vision.mrope_interleaved).rows(positions)
    half = rows.shape[1] // 2
    assert half == inv.shape[0]
    assert_within(rows[:, :half], cos, limit, f"{name} mrope cos")
    assert_within(rows[:, half:], sin, limit, f"{name} mrope sin")

    # text tokens (t = h = w) read the ordinary table
    table = cos_sin_cache(ours)
    assert table.shape == (ours.max_position, ours.rope_dim) and ours.max_position >= LONG
    text_rows = len(POSITIONS)
    assert_within(table[POSITIONS, :half], cos[:text_rows], limit[:text_rows], f"{name} text cos")
    assert_within(table[POSITIONS, half:], sin[:text_rows], limit[:text_rows], f"{name} text sin")


# --- dynamic NTK ----------------------------------------------------------------------------

@pytest.mark.parametrize("style", ["rope_parameters", "legacy_rope_scaling"])
def test_dynamic_ntk_is_refused_naming_the_type(style):
    """FreeToken does not implement dynamic NTK (transformers recomputes its frequencies from
    the sequence length). config.json parsing keeps the declared type; building the rotary
    table, which every model does, refuses it by name."""
    assert "dynamic" not in SUPPORTED_ROPE_TYPES
    raw = {**hf_config("default").to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    if style == "rope_parameters":
        raw["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1000000.0,
                                  "factor": 2.0}
    else:
        raw["rope_parameters"] = None
        raw["rope_theta"] = 1000000.0
        raw["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    ours = config_from_hf(raw, "config.json")
    assert ours.rope_scaling["rope_type"] == "dynamic"
    with pytest.raises(UnsupportedModelError, match=r"rope scaling 'dynamic' is not supported"):
        cos_sin_cache(ours)
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        MRopeRows(ours, (24, 20, 20), True)
