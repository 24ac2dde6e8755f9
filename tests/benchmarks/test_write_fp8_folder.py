"""benchmarks/write_fp8_folder.py: a tiny FP8 folder written by the same function as the
full-depth ones, read by FreeToken on the CPU (its FP8 weights kept in their format) and run
against transformers on the same weights decoded bit by bit into a float32 folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import write_fp8_folder as w
from tests.models.scaled_checkpoint import e4m3_values, expand


def float_copy(src, dst):
    """The FP8 folder as float32 (values x their block scales, numpy), for transformers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir()
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    out = {}
    for name, t in tensors.items():
        if name.endswith("scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name[:-len("weight")] + "weight_scale_inv" if name.endswith(
                ".weight") else name + "_scale_inv"]
            rows, cols = t.shape[-2:]
            values = e4m3_values(t.view(torch.uint8).numpy()) * expand(
                scale.double().numpy(), 128, 128, rows, cols)
            out[name] = torch.from_numpy(values.astype(np.float32))
        else:
            out[name] = t.float()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))


def test_a_tiny_folder_runs_in_fp8_on_the_cpu_as_transformers_on_its_values(tmp_path):
    from transformers import AutoModelForCausalLM

    from benchmarks.step_bytes import safetensors_weight_bytes
    from freetoken.models.forward.scaled_linear import HostScaledLinear
    from freetoken.models.forward.scaled_moe import HostScaledExperts
    from freetoken.models.loader import load_model
    from tests.models.test_dense_hf import run_and_compare

    folder = tmp_path / "fp8"
    counts = w.write_folder(folder, "tiny", seed=1, progress=lambda line: None)
    assert counts["layers"] == 2 and not (tmp_path / "fp8.part").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model-00000.safetensors", "model-00001.safetensors", "model-rest.safetensors"} == \
        set(index.values())
    assert "model.layers.1.mlp.experts.gate_up_proj_scale_inv" in index
    by_type = safetensors_weight_bytes(folder)["by_type"]
    assert by_type["F8_E4M3"] > by_type["BF16"] / 4          # projections and experts in FP8

    loaded = load_model(str(folder), device="cpu")
    layer = loaded.model.layers[0]
    assert isinstance(layer.mlp.scaled, HostScaledExperts)
    assert any(isinstance(v, HostScaledLinear) for v in vars(layer.attn).values())

    reference = tmp_path / "float"
    float_copy(folder, reference)
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    run_and_compare(loaded.model, hf)


def test_the_same_seed_writes_the_same_bytes(tmp_path):
    a = w.write_folder(tmp_path / "a", "tiny", layers=1, seed=3, progress=lambda line: None)
    b = w.write_folder(tmp_path / "b", "tiny", layers=1, seed=3, progress=lambda line: None)
    assert a == b
    for shard in ("model-00000.safetensors", "model-rest.safetensors"):
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()


@pytest.mark.parametrize("model, layers", [("qwen3-30b-a3b", 48), ("qwen3.6-35b-a3b", 40)])
def test_full_shapes_name_every_tensor_of_the_real_config(model, layers):
    """The meta-device table of the full models: every layer, fused experts, and (hybrid)
    Gated DeltaNet layers with full attention every fourth."""
    config, model_class = w.model_config(model, None)
    table = w.tensor_table(config, model_class)
    assert config.num_hidden_layers == layers
    assert max(w.layer_of(n) for n in table if w.layer_of(n) is not None) == layers - 1
    experts = table["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts == (config.num_experts, 2 * config.moe_intermediate_size, config.hidden_size)
    if model == "qwen3.6-35b-a3b":
        assert "model.layers.0.linear_attn.A_log" in table
        assert "model.layers.3.self_attn.q_proj.weight" in table


def test_the_full_depth_benchmark_reads_the_writers_progress_and_skips_llama_cpp(tmp_path,
                                                                                 capsys):
    """gpu_full_depth's FP8 rows: the writer's progress lines parse (every 8th shard shown),
    the folder's bytes count, and llama.cpp is skipped with the reason."""
    from benchmarks import gpu_full_depth

    lines = []
    w.write_folder(tmp_path / "m", "tiny", layers=1, progress=lines.append)
    for line in lines + [line.replace("shard 1/", "shard 8/") for line in lines[:1]]:
        gpu_full_depth._every_8th_shard(line)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 1 and printed[0].startswith("shard 8/")
    folder = tmp_path / "m"
    assert gpu_full_depth.checkpoint_bytes(folder) == sum(
        f.stat().st_size for f in folder.iterdir())
    assert "FreeToken's alone" in gpu_full_depth.llamacpp(folder, [0])["skipped"]
