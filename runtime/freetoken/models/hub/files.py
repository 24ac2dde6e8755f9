"""What FreeToken fetches from a repository: the files its loaders read, and no others.

A safetensors repository: config.json and tokenizer.json (required), the optional files the
loaders read (generation_config.json; tokenizer_config.json and chat_template.jinja for the
tokenizer, tokenizer/hf.py; preprocessor_config.json for a vision tower;
hf_quant_config.json for ModelOpt checkpoints, checkpoint/hf_quant.py), and the root
*.safetensors: those the index (model.safetensors.index.json) lists when there is one
(checkpoint/hf.py reads only those), else all. Never .bin/.pt/.msgpack/.onnx weights,
images, READMEs or subfolders. GGUF repositories: gguf_pick.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.errors import ModelFormatError, ModelOptionError

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
OPTIONAL_FILES = ("generation_config.json", "tokenizer_config.json", "chat_template.jinja",
                  "preprocessor_config.json", "hf_quant_config.json")


@dataclass(frozen=True)
class RepoFile:
    """One file of a repository at a commit, as the Hub lists it (sizes and hashes are None
    where the listing, e.g. a mirror's or the offline cache's, leaves them out)."""

    path: str
    size: int | None = None
    sha256: str | None = None     # LFS files: the sha256 of the content
    blob_id: str | None = None    # other files: git's blob id (sha1 of "blob <size>\0" + content)


def _root_safetensors(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if "/" not in p and p.endswith(".safetensors"))


def is_safetensors_repo(paths: list[str]) -> bool:
    """config.json and safetensors weights at the root: a folder the HF loader reads."""
    return CONFIG in paths and bool(_root_safetensors(paths))


def safetensors_metadata_files(paths: list[str], repo_id: str) -> list[str]:
    """config.json first (the architecture is checked from it before anything large), then
    the tokenizer, the optional files present, and the weight index if any."""
    if TOKENIZER not in paths:
        raise ModelOptionError(
            f"{repo_id} has no tokenizer.json, which FreeToken builds the tokenizer from "
            f"(a repository with only a SentencePiece tokenizer.model is not supported); "
            f"look for a GGUF version of the model")
    wanted = [CONFIG, TOKENIZER] + [p for p in OPTIONAL_FILES if p in paths]
    return wanted + ([SAFETENSORS_INDEX] if SAFETENSORS_INDEX in paths else [])


def safetensors_weight_files(paths: list[str], index: dict | None, repo_id: str) -> list[str]:
    """The weight files to fetch: the index's (a missing one is an error), else every root
    *.safetensors."""
    if index is None:
        return _root_safetensors(paths)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ModelFormatError(f"{repo_id}/{SAFETENSORS_INDEX}: missing 'weight_map'")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if f not in paths]
    if missing:
        raise ModelFormatError(f"{repo_id}/{SAFETENSORS_INDEX} lists {', '.join(missing)}, "
                               f"which the repository does not have")
    return files


def describe_weights(paths: list[str]) -> str:
    """What weights a repository that is neither kind holds, for the error message."""
    others = sorted({p.rsplit(".", 1)[-1] for p in paths
                     if p.endswith((".bin", ".pt", ".pth", ".msgpack", ".onnx", ".h5",
                                    ".safetensors", ".gguf"))})
    return f"it has {', '.join('.' + e for e in others)} files" if others else \
        "it has no weight files"
