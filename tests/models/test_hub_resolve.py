"""Models by Hub name (models/resolve.py, models/hub/) against a stand-in hub on the loopback:
which files are fetched (and only those), the :QUANT pick, split GGUFs, the cache and offline
mode, resume, integrity, and the errors. huggingface_hub never sees the real network."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from freetoken.models.errors import (ModelDownloadError, ModelFormatError, ModelOptionError,
                                     UnsupportedModelError)
from freetoken.models.loader import load_model
from freetoken.models.resolve import resolve_model
from tests.models.helpers import PagedRunner
from tests.models.hub_repos import (GATED, GGUF, GGUF_NO_DEFAULT, GPT2, GPT2_GGUF, SAFETENSORS,
                                    SHARDED, SPLIT, SPLIT_PARTS, build_repos, closed_port_url,
                                    huggingface_env, start_stand_in)
from tests.models.stand_in_hub import TOKEN
from tests.models.test_dense_hf import prompts


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    return build_repos(tmp_path_factory.mktemp("hub-repos"))


@pytest.fixture
def hf_home(tmp_path) -> Path:
    return tmp_path / "hf-home"


@pytest.fixture
def hub(repos, hf_home):
    """The stand-in hub serving every repository; huggingface_hub pointed at it with an empty
    cache of its own (HF_ENDPOINT, HF_HOME)."""
    stand_in = start_stand_in(repos)
    with huggingface_env(HF_ENDPOINT=stand_in.url, HF_HOME=str(hf_home)):
        yield stand_in
    stand_in.close()


def logits(path: str) -> torch.Tensor:
    loaded = load_model(path, device="cpu")
    a, b = prompts(loaded.config.vocab_size)
    return PagedRunner(loaded.model).step([(0, a), (1, b)])


def test_safetensors_repo_fetches_what_the_loader_reads_and_no_more(hub, repos):
    said = []
    resolved = resolve_model(SAFETENSORS, said.append)
    wanted = {"config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "model.safetensors"} & set(repos[SAFETENSORS].files)
    assert sorted(hub.whole_file_gets(SAFETENSORS)) == sorted(wanted)   # each once, only these
    assert resolved.name == SAFETENSORS
    folder = Path(resolved.path)
    assert folder.is_dir() and hub.repos[SAFETENSORS].commit == folder.name
    loaded = load_model(resolved.path, device="cpu")
    assert loaded.config.architecture == "llama"
    assert loaded.tokenizer.encode("hello world")
    assert any("fetching stand-in/tiny-llama/model.safetensors" in line for line in said)
    # the same model as its files read from anywhere else
    local = hub.repos[SAFETENSORS].files
    copy = folder.parent.parent.parent / "copy"
    copy.mkdir()
    for name in wanted:
        (copy / name).write_bytes(local[name])
    assert torch.equal(logits(resolved.path), logits(str(copy)))


def test_sharded_repo_fetches_its_index_and_the_shards_it_lists(hub, repos):
    resolved = resolve_model(SHARDED, lambda line: None)
    shards = {n for n in repos[SHARDED].files if n.startswith("model-")}
    assert len(shards) > 1
    fetched = hub.whole_file_gets(SHARDED)
    assert "model.safetensors.index.json" in fetched and shards <= set(fetched)
    assert "consolidated.safetensors" not in fetched     # at the root, but not in the index
    assert not any(n.endswith((".bin", ".msgpack", ".onnx", ".png", ".md")) for n in fetched)
    assert load_model(resolved.path, device="cpu").config.num_layers == 2


@pytest.mark.parametrize("name, picked", [
    (GGUF, "tiny-llama-Q4_K_M.gguf"),                  # default: Q4_K_M first
    (GGUF + ":Q8_0", "tiny-llama-Q8_0.gguf"),
    (GGUF + ":q8_0", "tiny-llama-Q8_0.gguf"),          # tags match case-insensitively
    (GGUF_NO_DEFAULT, "tiny-llama-Q4_0.gguf"),         # neither: the first model GGUF
])
def test_gguf_pick_fetches_one_file_and_no_sidecar(hub, name, picked):
    resolved = resolve_model(name, lambda line: None)
    repo_id = name.split(":")[0]
    assert Path(resolved.path).name == picked and resolved.name == name
    assert hub.whole_file_gets(repo_id) == [picked]
    assert load_model(resolved.path, device="cpu").config.architecture == "llama"


def test_a_quant_the_repo_lacks_names_the_ones_it_has(hub):
    with pytest.raises(ModelOptionError) as caught:
        resolve_model(GGUF + ":Q3_K_S", lambda line: None)
    assert "has no GGUF of type Q3_K_S; it has Q4_K_M, Q8_0" in str(caught.value)
    assert hub.whole_file_gets(GGUF) == [] and hub.ranged_gets(GGUF) == []


def test_split_gguf_is_fetched_whole_and_loads_as_the_one_file_model(hub):
    resolved = resolve_model(SPLIT, lambda line: None)     # Q8_0: the default's second choice
    assert Path(resolved.path).name == SPLIT_PARTS[0]
    assert sorted(hub.whole_file_gets(SPLIT)) == list(SPLIT_PARTS)
    assert sorted(p.name for p in Path(resolved.path).parent.iterdir()) == list(SPLIT_PARTS)
    single = resolve_model(GGUF + ":Q8_0", lambda line: None)
    assert torch.equal(logits(resolved.path), logits(single.path))


def test_offline_mode_uses_the_cache_and_fails_clearly_without_it(hub, hf_home):
    online = resolve_model(GGUF + ":Q8_0", lambda line: None).path
    hub.close()
    said = []
    with huggingface_env(HF_ENDPOINT=closed_port_url(), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1"):
        assert resolve_model(GGUF + ":Q8_0", said.append).path == online
        assert "HF_HUB_OFFLINE=1" in said[-1]
        with pytest.raises(ModelDownloadError, match="not in the Hugging Face cache and "
                                                     "HF_HUB_OFFLINE=1"):
            resolve_model(SAFETENSORS, said.append)
        with pytest.raises(ModelDownloadError, match="no GGUF of type Q6_K"):
            resolve_model(GGUF + ":Q6_K", said.append)


def test_an_unreachable_hub_falls_back_to_the_cache(hub, hf_home):
    online = resolve_model(SAFETENSORS, lambda line: None).path
    said = []
    with huggingface_env(HF_ENDPOINT=closed_port_url(), HF_HOME=str(hf_home)):
        assert resolve_model(SAFETENSORS, said.append).path == online
        assert "cannot be reached" in said[-1]
        with pytest.raises(ModelDownloadError, match="cannot reach http://127.0.0.1"):
            resolve_model(GGUF, said.append)


def test_an_interrupted_download_resumes_where_it_stopped(hub, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub writes what it received in 10 MB chunks; the stand-in file is smaller
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)
    name = "tiny-llama-Q8_0.gguf"
    hub.truncate_once.add((GGUF, name))
    path = Path(resolve_model(GGUF + ":Q8_0", lambda line: None).path)
    data = hub.repos[GGUF].files[name]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()
    assert hub.whole_file_gets(GGUF) == [name]       # started once, cut off halfway ...
    resumes = [r for p, r in hub.ranged_gets(GGUF) if p == name and r != "bytes=0-262143"]
    assert len(resumes) == 1                         # ... and continued from there
    offset = int(resumes[0].removeprefix("bytes=").removesuffix("-"))
    assert 0 < offset <= len(data) // 2


def test_a_corrupt_download_is_refused_and_removed_from_the_cache(hub):
    hub.corrupt.add((GGUF, "tiny-llama-Q8_0.gguf"))
    with pytest.raises(ModelDownloadError, match="sha256 is .* but the repository lists"):
        resolve_model(GGUF + ":Q8_0", lambda line: None)
    hub.corrupt.clear()
    path = resolve_model(GGUF + ":Q8_0", lambda line: None).path    # fetched again
    assert hub.whole_file_gets(GGUF) == ["tiny-llama-Q8_0.gguf"] * 2
    assert load_model(path, device="cpu").config.architecture == "llama"


def test_unsupported_architectures_are_refused_before_the_weights_download(hub):
    with pytest.raises(UnsupportedModelError) as caught:
        resolve_model(GPT2, lambda line: None)
    message = str(caught.value)
    assert "'GPT2LMHeadModel' is not supported; supported: " in message and "qwen3" in message
    assert hub.whole_file_gets(GPT2) == ["config.json"]
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2' is not supported"):
        resolve_model(GPT2_GGUF, lambda line: None)
    assert hub.whole_file_gets(GPT2_GGUF) == []       # only the header's range was read
    assert [r for _, r in hub.ranged_gets(GPT2_GGUF)] == ["bytes=0-262143"]


def test_a_gated_repo_needs_the_token(hub, hf_home, monkeypatch):
    with pytest.raises(ModelDownloadError, match=f"{GATED}: a gated repository; accept its "
                                                 f"conditions at .* then set HF_TOKEN"):
        resolve_model(GATED, lambda line: None)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert Path(resolve_model(GATED, lambda line: None).path).is_file()


def test_a_missing_repo_and_a_non_name_say_so(hub):
    with pytest.raises(ModelDownloadError, match="stand-in/nope: no such local path, and no "
                                                 "model repository stand-in/nope on "
                                                 "http://127.0.0.1:[0-9]+; check the spelling"):
        resolve_model("stand-in/nope", lambda line: None)
    with pytest.raises(ModelFormatError, match="no such file or directory"):
        resolve_model("not/a/repo", lambda line: None)


def test_an_existing_local_path_wins_over_the_hub(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path(SAFETENSORS).mkdir(parents=True)
    resolved = resolve_model(SAFETENSORS, lambda line: None)
    assert resolved.path == SAFETENSORS and resolved.name is None
    assert hub.requests == []
    assert resolve_model(None).path is None
