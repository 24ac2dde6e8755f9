"""A split GGUF (llama.cpp's gguf-split and converters: NAME-00001-of-0000N.gguf, ...) read as
one model, part by part: each part is memory-mapped where it lies, nothing is joined on disk.

Part 1 holds every metadata key plus ``split.no`` / ``split.count`` / ``split.tensors.count``;
the other parts hold only the split keys and their share of the tensors. As llama.cpp does,
a split model is opened by its first part and the others are found by name beside it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from freetoken.models.errors import ModelFormatError

# llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf"
SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$",
                        re.IGNORECASE)


def split_count(meta: dict[str, Any]) -> int:
    """How many parts the model whose (first part's) metadata this is has; 1 if not split."""
    return int(meta.get("split.count") or 1)


def model_stem(path: Path) -> str:
    """A GGUF file's name without `.gguf` and without a split suffix (-00001-of-00003)."""
    match = SPLIT_NAME.match(path.name)
    return match["prefix"] if match else path.stem


def part_paths(first: Path, count: int) -> list[Path]:
    """The paths of every part of a split model, from its first part's path."""
    match = SPLIT_NAME.match(first.name)
    if match is None or int(match["index"]) != 1 or int(match["count"]) != count:
        raise ModelFormatError(
            f"{first}: the first part of a split GGUF of {count} parts, but its name does not "
            f"end in -00001-of-{count:05d}.gguf, so its other parts cannot be found; keep the "
            f"part names llama.cpp's gguf-split gave them")
    return [first.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf")
            for i in range(1, count + 1)]


class GGUFSplitFiles:
    """The parts of a split model behind GGUFFile's interface: ``meta`` is part 1's metadata,
    ``tensors`` the union of every part's tensor table; ``array``/``release`` go to the part
    that holds the tensor."""

    def __init__(self, parts: list, paths: list[Path]):
        self.meta = parts[0].meta
        self.tensors = {}
        self._part_of: dict[str, Any] = {}
        for part, path in zip(parts, paths):
            for name, info in part.tensors.items():
                if name in self.tensors:
                    raise ModelFormatError(f"{path}: tensor {name!r} is also in another part "
                                           f"of the split model")
                self.tensors[name] = info
                self._part_of[name] = part
        expected = self.meta.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise ModelFormatError(
                f"{paths[0]}: the split model lists {int(expected)} tensors but its "
                f"{len(paths)} parts hold {len(self.tensors)}; a part is from another "
                f"model or incomplete, download the parts again")

    def array(self, info):
        return self._part_of[info.name].array(info)

    def release(self, info) -> None:
        self._part_of[info.name].release(info)


def open_split(first_file, path: Path, open_part: Callable[[Path], Any]):
    """`first_file` (the parsed `path`) itself, or with its other parts when it is part 1 of a
    split model. `open_part` parses one more part (the caller's error handling included)."""
    count = split_count(first_file.meta)
    if count <= 1:
        return first_file
    index = int(first_file.meta.get("split.no") or 0)
    if index != 0:
        match = SPLIT_NAME.match(path.name)
        first = (f"{match['prefix']}-00001-of-{count:05d}.gguf" if match else
                 "its first part")
        raise ModelFormatError(f"{path}: part {index + 1} of a split GGUF of {count} parts; "
                               f"load the model by its first part, {first}")
    paths = part_paths(path, count)
    parts = [first_file]
    for number, part_path in enumerate(paths[1:], start=2):
        if not part_path.is_file():
            raise ModelFormatError(f"{part_path}: missing; part {number} of {count} of the "
                                   f"split model {path.name} (every part must lie beside "
                                   f"the first)")
        part = open_part(part_path)
        if int(part.meta.get("split.no", -1)) != number - 1:
            raise ModelFormatError(f"{part_path}: its split.no is "
                                   f"{part.meta.get('split.no')}, expected {number - 1}; the "
                                   f"part is from another split")
        parts.append(part)
    return GGUFSplitFiles(parts, paths)
