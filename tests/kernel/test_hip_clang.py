"""FREETOKEN_HIP_CLANG selects the clang that builds ROCm kernels, in the cache build and JIT."""

from __future__ import annotations

import shutil

import pytest

from freetoken import env as ft_env
from freetoken.kernel import jit
from freetoken.kernel.errors import KernelUnavailable
from freetoken.toolchain import checks
from tests.conftest import REPO

MISSING = "/nonexistent/bin/clang-99"


def _backend():
    import importlib.util
    import sys

    name = "freetoken_cache_backend_under_test"
    if name not in sys.modules:
        path = REPO / "kernel-cache" / "backend" / "freetoken_cache_backend.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_env_reads_the_variable():
    assert ft_env.read({"FREETOKEN_HIP_CLANG": " /opt/x/clang++ "}).hip_clang == "/opt/x/clang++"
    assert ft_env.read({"FREETOKEN_HIP_CLANG": ""}).hip_clang is None
    assert ft_env.read({}).hip_clang is None
    assert "FREETOKEN_HIP_CLANG" in ft_env.VARIABLES


def test_missing_clang_is_an_error_naming_the_variable():
    with pytest.raises(checks.ToolchainError, match="FREETOKEN_HIP_CLANG=.*clang-99"):
        checks.find_hip_clang(MISSING)


def test_a_non_clang_is_refused(tmp_path):
    fake = tmp_path / "clang"
    fake.write_text("#!/bin/sh\necho 'gcc (Debian 12.2.0) 12.2.0'\n")
    fake.chmod(0o755)
    with pytest.raises(checks.ToolchainError, match="FREETOKEN_HIP_CLANG"):
        checks.find_hip_clang(str(fake))


def test_the_named_clang_is_used():
    clang = shutil.which("clang-19")
    if clang is None:
        pytest.skip("clang-19 is not installed")
    found = checks.find_hip_clang(clang)
    assert found.path == clang and found.major == 19


def test_cache_build_uses_it(monkeypatch):
    backend = _backend()  # loads toolchain/checks.py by path: its own ToolchainError class
    with pytest.raises(backend.checks.ToolchainError, match="FREETOKEN_HIP_CLANG"):
        backend.select_targets(("cpu",), MISSING)
    clang = shutil.which("clang-19")
    if clang is None:
        pytest.skip("clang-19 is not installed")
    targets, facts = backend.select_targets(("rocm",), clang)
    assert targets == ["gfx1151", "gfx1201"] and facts["hip_clang"].path == clang


def test_jit_reports_it_as_unavailable(monkeypatch):
    monkeypatch.setenv("FREETOKEN_HIP_CLANG", MISSING)
    with pytest.raises(KernelUnavailable, match="FREETOKEN_HIP_CLANG"):
        jit.toolchain_for("rocm", ft_env.read())
