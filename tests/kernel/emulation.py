"""Builds a tests/kernel/*_emu.cc host run of GPU kernel bodies (against the CUDA stand-in in
tests/kernel/emu/) and returns its one C entry point; the output check the emulated tests
share."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


_BUILT: dict[str, ctypes.CDLL] = {}


def build_emulation(tmp_path_factory, stem: str, restype, argtypes: list,
                    entry: str | None = None) -> ctypes._CFuncPtr:
    """ft_<entry> (default ft_<stem>) from tests/kernel/<stem>.cc, compiled with g++ once per
    session (skips without one)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    if stem not in _BUILT:
        so = tmp_path_factory.mktemp(stem.replace("_", "-")) / f"{stem}.so"
        subprocess.run([cxx, "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wall",
                        "-Werror", "-Wno-unknown-pragmas", f"-I{HERE / 'emu'}",
                        f"-I{REPO / 'kernels/include'}", str(HERE / f"{stem}.cc"), "-o",
                        str(so)], check=True)
        _BUILT[stem] = ctypes.CDLL(str(so))
    fn = getattr(_BUILT[stem], f"ft_{entry or stem}")
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def assert_bf16_within(out, want: np.ndarray, bound, msg: str = "") -> None:
    """A bf16 kernel output within `bound` of the float64 `want`, plus one bf16 rounding on each
    side of it; every value finite."""
    from tests.tolerances import EPS

    got = out.double().numpy()
    limit = bound + 2 * EPS["bfloat16"] * np.abs(want)
    err = np.abs(got - want)
    assert np.isfinite(got).all(), f"non-finite output {msg}"
    assert (err <= limit).all(), f"max error {err.max():.3g} {msg}"
