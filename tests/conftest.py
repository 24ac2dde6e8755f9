"""Shared fixtures: an isolated kernel environment and process helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def compiler_free_env(extra: dict | None = None) -> dict:
    """os.environ with no compiler reachable: PATH holds only this interpreter's folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CXX", "CC")}
    env["PATH"] = str(Path(sys.executable).parent)
    env.update(extra or {})
    return env


@pytest.fixture
def jit_only(monkeypatch, tmp_path):
    """No kernel cache, JIT allowed, into a private JIT folder; loaded modules forgotten."""
    from freetoken.kernel import loader

    jit_dir = tmp_path / "jit"
    monkeypatch.setenv("FREETOKEN_DISABLE_KERNEL_CACHE", "1")
    monkeypatch.setenv("FREETOKEN_JIT_DIR", str(jit_dir))
    monkeypatch.setenv("FREETOKEN_DISABLE_JIT", "0")
    loader.clear_loaded()
    yield jit_dir
    loader.clear_loaded()
