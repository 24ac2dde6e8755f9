"""Which files a Hub name picks, without a hub: llama.cpp's -hf GGUF rule (common/download.cpp
find_best_model / get_split_files), the files of a safetensors repository, the name syntax."""

from __future__ import annotations

import pytest

from freetoken.models.errors import ModelFormatError, ModelOptionError
from freetoken.models.hub.files import safetensors_metadata_files, safetensors_weight_files
from freetoken.models.hub.gguf_pick import parse_gguf_name, pick_gguf, quant_tags
from freetoken.models.hub.pull import is_gguf_choice
from freetoken.models.hub.reference import HubReference, parse_reference

REPO = ["README.md", ".gitattributes", "Model-BF16.gguf", "Model-Q8_0.gguf",
        "Model-Q4_K_M.gguf", "Model-Q4_K_S.gguf", "mmproj-Model-Q4_K_M.gguf",
        "Model.imatrix.gguf", "mtp-Model-Q4_K_M.gguf"]


@pytest.mark.parametrize("quant, picked", [
    (None, ["Model-Q4_K_M.gguf"]), ("Q8_0", ["Model-Q8_0.gguf"]),
    ("bf16", ["Model-BF16.gguf"]), ("Q4_K_S", ["Model-Q4_K_S.gguf"])])
def test_quant_picks_the_matching_model_file_never_a_sidecar(quant, picked):
    assert pick_gguf(REPO, quant, "o/n") == picked


def test_default_falls_back_to_q8_0_then_the_first_model_file():
    assert pick_gguf([p for p in REPO if "Q4_K_M" not in p], None, "o/n") == ["Model-Q8_0.gguf"]
    only = ["mmproj-a-F16.gguf", "z-Q5_K_M.gguf", "b-Q6_K.gguf", "a.imatrix.gguf"]
    assert pick_gguf(only, None, "o/n") == ["b-Q6_K.gguf"]     # path order, sidecars skipped


def test_a_split_model_is_picked_by_its_first_part_with_every_part():
    parts = [f"Q4_K_M/Big-Q4_K_M-0000{i}-of-00003.gguf" for i in (3, 1, 2)]
    repo = parts + ["Big-Q8_0.gguf", "Q4_K_M/Other-Q4_K_M-00001-of-00002.gguf"]
    assert pick_gguf(repo, None, "o/n") == sorted(parts)
    assert pick_gguf(repo, "Q8_0", "o/n") == ["Big-Q8_0.gguf"]
    assert parse_gguf_name(parts[0]).index == 3 and parse_gguf_name(parts[0]).tag == "Q4_K_M"
    with pytest.raises(ModelOptionError, match="part 2 is missing from the repository"):
        pick_gguf(parts[:2], None, "o/n")


def test_a_missing_quant_lists_those_the_repo_has():
    with pytest.raises(ModelOptionError) as caught:
        pick_gguf(REPO, "Q3_K_S", "o/n")
    assert "o/n has no GGUF of type Q3_K_S; it has BF16, Q4_K_M, Q4_K_S, Q8_0" in str(
        caught.value)
    # a file without a tag is named by its path; a split set counts once
    assert quant_tags(["m-00002-of-00002.gguf", "m-00001-of-00002.gguf", "m-Q8_0.gguf"]) == [
        "m-00001-of-00002.gguf", "Q8_0"]


def test_format_choice_and_safetensors_files():
    safetensors = ["config.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json", "model.safetensors", "pytorch_model.bin",
                   "onnx/model.onnx", "sub/model.safetensors", "logo.png", "vocab.json"]
    assert not is_gguf_choice(HubReference("o/n"), safetensors)
    assert is_gguf_choice(HubReference("o/n"), safetensors + ["n-Q4_0.gguf"])
    with pytest.raises(ModelOptionError, match="has no GGUF files, so :Q4_K_M picks nothing"):
        is_gguf_choice(HubReference("o/n", "Q4_K_M"), safetensors)
    with pytest.raises(ModelOptionError, match=r"it has \.bin, \.pt files"):
        is_gguf_choice(HubReference("o/n"), ["config.json", "a.bin", "b.pt"])
    assert safetensors_metadata_files(safetensors, "o/n") == [
        "config.json", "tokenizer.json", "generation_config.json", "tokenizer_config.json"]
    assert safetensors_weight_files(safetensors, None, "o/n") == ["model.safetensors"]
    sharded = ["model-1.safetensors", "model-2.safetensors", "consolidated.safetensors"]
    index = {"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors",
                            "c": "model-1.safetensors"}}
    assert safetensors_weight_files(sharded, index, "o/n") == sharded[:2]
    with pytest.raises(ModelFormatError, match="lists model-2.safetensors"):
        safetensors_weight_files(sharded[:1], index, "o/n")
    with pytest.raises(ModelOptionError, match="no tokenizer.json"):
        safetensors_metadata_files(["config.json", "model.safetensors"], "o/n")


@pytest.mark.parametrize("text, ref", [
    ("Qwen/Qwen3-0.6B", HubReference("Qwen/Qwen3-0.6B")),
    ("unsloth/Qwen3-0.6B-GGUF:Q4_K_M", HubReference("unsloth/Qwen3-0.6B-GGUF", "Q4_K_M")),
    ("org/name:UD-Q4_K_XL", HubReference("org/name", "UD-Q4_K_XL")),
    ("./model.gguf", None), ("/abs/model", None), ("a/b/c", None), ("org/", None),
    ("org/name:", None)])
def test_names(text, ref):
    assert parse_reference(text) == ref
