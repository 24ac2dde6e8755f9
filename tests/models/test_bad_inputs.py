"""Bad model inputs raise named errors whose messages name the file and the culprit."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from freetoken.models.errors import (MissingTensorError, ModelFormatError, ModelOptionError,
                                     UnsupportedModelError)
from freetoken.models.loader import load_model
from tests.models.tiny_gguf import write_gguf

Q2_K = 10   # a type no CPU kernel reads


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.needs_weights
def test_truncated_default_gguf(tmp_path):
    from freetoken.models.checkpoint.default import default_model_path

    cut = tmp_path / "cut.gguf"
    with open(default_model_path(), "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelFormatError, match="truncated") as info:
        load_model(str(cut))
    assert str(cut) in str(info.value)
    assert "tokenizer.ggml" in str(info.value)    # where the metadata stops


def test_truncated_tensor_data_names_the_tensor(tiny_checkpoint, tmp_path):
    directory, hf = tiny_checkpoint("llama")
    whole = tmp_path / "whole.gguf"
    write_gguf(hf, directory, whole, "llama", None)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-4096])
    with pytest.raises(ModelFormatError, match=r"tensor '[^']+' ends past the end") as info:
        load_model(str(cut))
    assert str(cut) in str(info.value)


def test_unsupported_gguf_architecture(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'") as info:
        load_model(str(path))
    message = str(info.value)
    assert str(path) in message and "llama" in message and "qwen3" in message


def test_unsupported_quant_type_names_tensor_and_type(tiny_checkpoint, tmp_path):
    directory, hf = tiny_checkpoint("llama")
    path = tmp_path / "q2k.gguf"
    blocks = np.zeros((128, 84), dtype=np.uint8)        # 128 rows of one 256-value Q2_K block
    write_gguf(hf, directory, path, "llama", None, raw={"blk.0.ffn_gate.weight": (blocks, Q2_K)})
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_gate.weight") as info:
        load_model(str(path))
    assert "Q2_K" in str(info.value) and str(path) in str(info.value)


def test_gguf_missing_tensor(tiny_checkpoint, tmp_path):
    directory, hf = tiny_checkpoint("llama")
    path = tmp_path / "missing.gguf"
    write_gguf(hf, directory, path, "llama", None, skip=("blk.1.attn_v.weight",))
    with pytest.raises(MissingTensorError, match="blk.1.attn_v.weight") as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_unknown_hf_architecture(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    copy = copy_checkpoint(directory, tmp_path / "model")
    config = json.loads((copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model(str(copy))
    assert "LlamaForCausalLM" in str(info.value)


def test_hf_missing_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    directory, _ = tiny_checkpoint("qwen2")
    copy = copy_checkpoint(directory, tmp_path / "model")
    weights = load_file(copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match="model.layers.1.self_attn.k_proj.bias"):
        load_model(str(copy))


def test_hf_wrong_shape(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    copy = copy_checkpoint(directory, tmp_path / "model")
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 96
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=r"gate_proj.weight' has shape \[128, 64\]"):
        load_model(str(copy))


def test_truncated_safetensors(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    copy = copy_checkpoint(directory, tmp_path / "model")
    data = (copy / "model.safetensors").read_bytes()
    (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="model.safetensors"):
        load_model(str(copy))


def test_missing_paths_and_files(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file or directory"):
        load_model(str(tmp_path / "nothing.gguf"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelFormatError, match="config.json"):
        load_model(str(tmp_path))


def test_bad_options(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    with pytest.raises(ModelOptionError, match="dtype 'int8'"):
        load_model(str(directory), dtype="int8")
    with pytest.raises(ModelOptionError, match="device 'tpu'"):
        load_model(str(directory), device="tpu")
