"""Session fixtures: the cache wheel built from this tree, and a fresh venv holding the pair."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


def _pip_wheel(source: Path, out: Path, env: dict | None = None) -> Path:
    before = set(out.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(source)], check=True, env={**os.environ, **(env or {})})
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


@pytest.fixture(scope="session")
def cache_wheel(tmp_path_factory) -> Path:
    """The cache wheel for FREETOKEN_CACHE_TARGETS (default: every target with a compiler)."""
    prebuilt = os.environ.get("FREETOKEN_TEST_CACHE_WHEEL")
    if prebuilt:
        return Path(prebuilt)
    return _pip_wheel(REPO / "kernel-cache", tmp_path_factory.mktemp("cache-wheel"))


@pytest.fixture(scope="session")
def runtime_wheel(tmp_path_factory) -> Path:
    return _pip_wheel(REPO, tmp_path_factory.mktemp("runtime-wheel"))


@pytest.fixture(scope="session")
def cache_dir(cache_wheel, tmp_path_factory) -> Path:
    """The wheel's cache folder, unpacked (tests may copy and damage it)."""
    out = tmp_path_factory.mktemp("cache-unpacked")
    with zipfile.ZipFile(cache_wheel) as zf:
        zf.extractall(out)
    return out / "freetoken_kernel_cache" / "cache"


@pytest.fixture(scope="session")
def fresh_venv(tmp_path_factory, runtime_wheel, cache_wheel) -> Path:
    """A new venv with CPU torch, the runtime wheel, the cache wheel and pytest."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + [str(runtime_wheel), str(cache_wheel), "pytest"], check=True)
    return venv
