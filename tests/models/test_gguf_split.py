"""Split GGUFs (NAME-00001-of-0000N.gguf, ...) load part by part, from where the parts lie: the
same tensors, metadata and logits as the one-file model, and no file joined on disk."""

from __future__ import annotations

import shutil

import pytest
import torch

from freetoken.kernel.ops import Q8_0
from freetoken.models.checkpoint.gguf import open_gguf
from freetoken.models.checkpoint.gguf_split import GGUFSplitFiles, model_stem
from freetoken.models.errors import ModelFormatError
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner
from tests.models.test_dense_hf import prompts
from tests.models.tiny_gguf import write_gguf

PARTS = ("tiny-Q8_0-00001-of-00003.gguf", "tiny-Q8_0-00002-of-00003.gguf",
         "tiny-Q8_0-00003-of-00003.gguf")


@pytest.fixture(scope="module")
def one_and_split(tiny_checkpoint, tmp_path_factory):
    """(the one-file GGUF, the folder of the same model split in three parts)."""
    directory, hf = tiny_checkpoint("llama")
    single = tmp_path_factory.mktemp("single") / "tiny-Q8_0.gguf"
    write_gguf(hf, directory, single, "llama", Q8_0)
    split = tmp_path_factory.mktemp("split")
    write_gguf(hf, directory, split / "tiny-Q8_0.gguf", "llama", Q8_0, split_max_tensors=8)
    assert sorted(p.name for p in split.iterdir()) == list(PARTS)
    return single, split


def test_parts_read_as_one_file(one_and_split):
    single, split = one_and_split
    whole, parts = open_gguf(single), open_gguf(split / PARTS[0])
    assert isinstance(parts, GGUFSplitFiles)
    assert parts.tensors.keys() == whole.tensors.keys()
    for name, info in whole.tensors.items():
        assert bytes(parts.array(parts.tensors[name])) == bytes(whole.array(info)), name
    assert {k: v for k, v in parts.meta.items() if not k.startswith("split.")} == whole.meta


def test_split_model_gives_the_logits_of_the_one_file_model(one_and_split):
    single, split = one_and_split
    before = sorted(split.iterdir())
    whole = load_model(str(single), device="cpu")
    joined = load_model(str(split / PARTS[0]), device="cpu")
    assert joined.name == "tiny-Q8_0" == model_stem(split / PARTS[0])
    a, b = prompts(whole.config.vocab_size)
    expected = PagedRunner(whole.model).step([(0, a), (1, b)])
    assert torch.equal(PagedRunner(joined.model).step([(0, a), (1, b)]), expected)
    assert sorted(split.iterdir()) == before     # nothing joined or written beside the parts


def test_split_errors_name_the_part_and_the_fix(one_and_split, tmp_path):
    _, split = one_and_split
    with pytest.raises(ModelFormatError, match="load the model by its first part, "
                                               f"{PARTS[0]}"):
        load_model(str(split / PARTS[1]))
    for name in PARTS[::2]:
        shutil.copy(split / name, tmp_path / name)
    with pytest.raises(ModelFormatError, match=f"{PARTS[1]}: missing; part 2 of 3"):
        load_model(str(tmp_path / PARTS[0]))
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(split / PARTS[0], renamed)
    with pytest.raises(ModelFormatError, match="does not end in -00001-of-00003.gguf"):
        load_model(str(renamed))
