"""FP8 and NVFP4 HF checkpoints on the CPU (dequantized at load) against a float reference built
from the same bytes (tests/models/scaled_checkpoint.py), dense and MoE, every layout.

Shapes are chosen so that 128x128 blocks do not divide them (hidden 192, q/k/v rows 192 and
96, MLP width 320, expert width 160): each matrix has several blocks and cut edge blocks, so a
scale applied to the wrong rows or columns (e.g. an unexpanded block grid) shows at once.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from freetoken.models.checkpoint.hf import read_hf_dir
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.loader import load_model
from freetoken.models.quant import scaled
from tests.models.scaled_checkpoint import LAYOUTS, e4m3_values, expand, write_scaled
from tests.models.helpers import tiny_hf_model
from tests.models.test_dense_hf import run_and_compare
from tests.tolerances import assert_close

SHAPES = dict(hidden_size=192, head_dim=48, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=320)
MOE = dict(num_hidden_layers=3, mlp_only_layers=[1], moe_intermediate_size=160)


@pytest.fixture(scope="module")
def float_models(tmp_path_factory):
    """arch -> directory of a float32 tiny model with FP8-unfriendly shapes."""
    built = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"float-{arch}")
            tiny_hf_model(arch, directory, **SHAPES, **(MOE if arch == "qwen3_moe" else {}))
            built[arch] = directory
        return built[arch]

    return get


def _hf_reference(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory / "reference",
                                                dtype=torch.float32, use_kernels=False).eval()


def _loaded_weight(directory, canonical: str):
    _, tensors, _, _ = read_hf_dir(directory)
    return tensors.get(canonical)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dense_weights_and_logits_match_the_reference(layout, float_models, tmp_path):
    directory, refs = write_scaled(float_models("qwen3"), tmp_path / layout, layout)
    for canonical, name in (("layers.0.q", "model.layers.0.self_attn.q_proj.weight"),
                            ("layers.0.k", "model.layers.0.self_attn.k_proj.weight"),
                            ("layers.1.down", "model.layers.1.mlp.down_proj.weight")):
        weight = _loaded_weight(directory, canonical)
        assert isinstance(weight, scaled.ScaledWeight)
        # FP8: one float32 product per value on both sides, so equal; NVFP4 multiplies by the
        # second-level scale (or its reciprocal) in another order: one float32 rounding
        assert_close(scaled.dequantize(weight), refs[name], torch.float32, ulps=2,
                     magnitude=np.abs(refs[name]), msg=f"{layout} {name}")
    ignored = _loaded_weight(directory, "layers.1.o")
    assert isinstance(ignored, torch.Tensor) and ignored.dtype == torch.float32
    loaded = load_model(str(directory), device="cpu")
    run_and_compare(loaded.model, _hf_reference(directory))


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
@pytest.mark.parametrize("layout", ["fp8-block", "ct-channel", "modelopt-fp8", "ct-nvfp4"])
def test_moe_experts_match_the_reference(layout, fused, float_models, tmp_path):
    directory, refs = write_scaled(float_models("qwen3_moe"), tmp_path / layout, layout,
                                   fused_experts=fused)
    experts = _loaded_weight(directory, "layers.0.experts.gate")
    assert isinstance(experts, scaled.ScaledWeight) and experts.shape == (8, 160, 192)
    if fused:
        expected = refs["model.layers.0.mlp.experts.gate_up_proj"][:, :160]
    else:
        expected = np.stack([refs[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"]
                             for e in range(8)])
    assert_close(scaled.dequantize(experts), expected, torch.float32, ulps=2,
                 magnitude=np.abs(expected), msg=layout)
    loaded = load_model(str(directory), device="cpu")
    run_and_compare(loaded.model, _hf_reference(directory))


def test_reference_decoder_catches_an_unexpanded_block_grid(float_models, tmp_path):
    """The scale grid has several distinct blocks per matrix: applying block (0, 0)'s scale
    everywhere (what broadcasting an unexpanded [1, 1] slice does) is far off the values."""
    directory, refs = write_scaled(float_models("qwen3"), tmp_path / "m", "fp8-block")
    weight = _loaded_weight(directory, "layers.1.down")          # [192, 320]: 2 x 3 blocks
    assert tuple(weight.scales.shape) == (2, 3)
    values = e4m3_values(weight.data.view(torch.uint8).numpy())
    wrong = values * weight.scales[0, 0].item()
    right = values * expand(weight.scales.double().numpy(), 128, 128, 192, 320)
    np.testing.assert_array_equal(right, refs["model.layers.1.mlp.down_proj.weight"])
    assert np.abs(wrong - right).max() > 0.05 * np.abs(right).max()


def _edit_config(directory, **quant):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(quant)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, match", [
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
])
def test_unsupported_fp8_variants_are_refused_by_name(edit, match, float_models, tmp_path):
    directory, _ = write_scaled(float_models("qwen3"), tmp_path / "m", "fp8-block")
    _edit_config(directory, **edit)
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(str(directory))


def test_compressed_tensors_int4_is_refused_by_name(float_models, tmp_path):
    directory, _ = write_scaled(float_models("qwen3"), tmp_path / "m", "ct-channel")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        num_bits=4, type="int", strategy="group", group_size=128)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="4-bit int weights with strategy 'group'"):
        load_model(str(directory))


def test_modelopt_other_algorithms_are_refused_by_name(float_models, tmp_path):
    directory, _ = write_scaled(float_models("qwen3"), tmp_path / "m", "modelopt-fp8")
    (directory / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(UnsupportedModelError, match="ModelOpt quant_algo 'W4A8_AWQ'"):
        load_model(str(directory))


def test_a_block_grid_of_the_wrong_shape_names_the_tensor(float_models, tmp_path):
    directory, _ = write_scaled(float_models("qwen3"), tmp_path / "m", "fp8-block")
    _edit_config(directory, weight_block_size=[64, 64])     # the file holds 128x128 grids
    with pytest.raises(ModelFormatError, match=r"q_proj.weight_scale_inv' has shape \[2, 2\]"):
        load_model(str(directory))
