"""Which GGUF files of a repository make the model: llama.cpp's `-hf ORG/NAME[:QUANT]` rule
(`find_best_model`, `get_split_files` in common/download.cpp of llama.cpp, as vendored by
llama-cpp-python 0.3.36), so a name picks the same file in both.

- ``:QUANT`` given: the first model GGUF whose path contains QUANT followed by '.' or '-'
  (case-insensitive); none is an error (no fallback).
- absent: Q4_K_M, else Q8_0, else the first model GGUF of the repository.
- "model GGUF": a .gguf file whose name holds none of the sidecar markers below (projectors
  for images, importance matrices, draft and MTP heads); of a split model only its first
  part (-00001-of-0000N) counts, and the pick brings every part of its set.
Files are taken in path order, the order of the Hub's listing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from freetoken.models.errors import ModelOptionError

DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")
SIDECAR_MARKERS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
_SPLIT = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(frozen=True)
class GGUFName:
    """What a GGUF path says about itself: the path without `.gguf` and split suffix, its
    quantization tag (upper case; '' when none), and its place in a split set."""

    prefix: str
    tag: str
    index: int = 1
    count: int = 1


def parse_gguf_name(path: str) -> GGUFName | None:
    """llama.cpp's get_gguf_split_info; None for a path that does not end in `.gguf`."""
    if not path.endswith(".gguf"):
        return None
    prefix, index, count = path[:-len(".gguf")], 1, 1
    split = _SPLIT.match(prefix)
    if split:
        prefix, index, count = split[1], int(split[2]), int(split[3])
    tag = _TAG.search(prefix)
    return GGUFName(prefix, tag[1].upper() if tag else "", index, count)


def is_model_gguf(path: str) -> bool:
    """A .gguf file that is a model, not a sidecar (llama.cpp's gguf_filename_is_model)."""
    if not path.endswith(".gguf"):
        return False
    name = path.rsplit("/", 1)[-1]
    return not any(marker in name for marker in SIDECAR_MARKERS)


def _is_first_part(path: str) -> bool:
    name = parse_gguf_name(path)
    return name is not None and (name.count <= 1 or name.index == 1)


def find_best_model(paths: list[str], quant: str | None) -> str | None:
    """The path of the model GGUF (a split model's first part) the rule picks, or None."""
    candidates = [p for p in sorted(paths) if is_model_gguf(p) and _is_first_part(p)]
    for tag in (quant,) if quant else DEFAULT_QUANTS:
        pattern = re.compile(re.escape(tag) + r"[.-]", re.IGNORECASE)
        for path in candidates:
            if pattern.search(path):
                return path
    if quant is None and candidates:
        return candidates[0]
    return None


def split_set(paths: list[str], first: str) -> list[str]:
    """Every part of the model whose first part is `first` (itself when not split), in part
    order; a part missing from `paths` is an error."""
    name = parse_gguf_name(first)
    if name is None or name.count <= 1:
        return [first]
    parts = {}
    for path in paths:
        other = parse_gguf_name(path)
        if other is not None and other.count == name.count and other.prefix == name.prefix:
            parts[other.index] = path
    missing = [i for i in range(1, name.count + 1) if i not in parts]
    if missing:
        which = (f"part {missing[0]} is" if len(missing) == 1 else
                 f"parts {', '.join(map(str, missing))} are")
        raise ModelOptionError(f"{first}: {which} missing from the repository (a model of "
                               f"{name.count} parts)")
    return [parts[i] for i in range(1, name.count + 1)]


def quant_tags(paths: list[str]) -> list[str]:
    """The quantization tags of the repository's model GGUFs, in path order (for messages)."""
    tags = []
    for path in sorted(paths):
        if is_model_gguf(path) and _is_first_part(path):
            tag = parse_gguf_name(path).tag or path
            if tag not in tags:
                tags.append(tag)
    return tags


def pick_gguf(paths: list[str], quant: str | None, repo_id: str) -> list[str]:
    """The files (every part) of the model GGUF the rule picks from a repository's `paths`.
    Raises ModelOptionError naming the quantizations the repository has."""
    first = find_best_model(paths, quant)
    if first is None:
        have = quant_tags(paths)
        if not have:
            raise ModelOptionError(f"{repo_id} has no model GGUF file")
        raise ModelOptionError(
            f"{repo_id} has no GGUF of type {quant}; it has {', '.join(have)} "
            f"(pass {repo_id}:{have[0]}, or {repo_id} for the default pick)")
    return split_set(paths, first)
