"""Builds a tests/kernel/*_emu.cc host run of GPU kernel bodies (against the CUDA stand-in in
tests/kernel/emu/) and returns its one C entry point."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def build_emulation(tmp_path_factory, stem: str, restype, argtypes: list) -> ctypes._CFuncPtr:
    """ft_<stem> from tests/kernel/<stem>.cc, compiled with g++ (skips without one)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    so = tmp_path_factory.mktemp(stem.replace("_", "-")) / f"{stem}.so"
    subprocess.run([cxx, "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wall",
                    "-Werror", "-Wno-unknown-pragmas", f"-I{HERE / 'emu'}",
                    f"-I{REPO / 'kernels/include'}", str(HERE / f"{stem}.cc"), "-o", str(so)],
                   check=True)
    fn = getattr(ctypes.CDLL(str(so)), f"ft_{stem}")
    fn.restype, fn.argtypes = restype, argtypes
    return fn
