"""Shared fixtures: an isolated kernel environment and process helpers."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _import_installed_kernels_package() -> None:
    """transformers >= 5.25 imports the `kernels` package (hub kernels) when it is installed.
    This repository's kernels/ folder (the kernel sources) has the same name and, with the
    repository root first on sys.path, would be imported in its place: import the installed
    package first, from a path without the repository, so every later import gets it."""
    import importlib
    import importlib.metadata

    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]
    try:
        importlib.import_module("kernels")
    finally:
        sys.path[:] = saved


_import_installed_kernels_package()


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


MOE_OPS = ("moe_topk_softmax", "moe_experts", "moe_experts_quant")


def registry_has_moe_kernel() -> bool:
    from freetoken.csrc.build import registry

    return "moe" in registry.KERNELS_BY_NAME


@pytest.fixture
def moe_ops(monkeypatch):
    """The MoE ops for model tests: the registry's kernels when this build has them, else the
    numpy/torch references of kernel/reference.py (same contract) put in their place."""
    if not registry_has_moe_kernel():
        from freetoken.kernel import ops, reference

        for name in MOE_OPS:
            monkeypatch.setattr(ops, name, getattr(reference, name))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A `needs_weights` test whose model cannot be fetched (no route to the package index, as
    on an offline GPU machine) is reported skipped with the reason, not failed."""
    outcome = yield
    if call.excinfo is None or item.get_closest_marker("needs_weights") is None:
        return
    from freetoken.models.errors import ModelDownloadError

    if call.excinfo.errisinstance(ModelDownloadError):
        report = outcome.get_result()
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           f"Skipped: model weights unavailable: {call.excinfo.value}")
