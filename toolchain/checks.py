"""Toolchain checks shared by the cache build and the runtime JIT.

Stdlib only and loaded by file path, so a build backend can use it without importing freetoken.
Each check returns a ``Problem`` (what is wrong, what would go wrong, the fix) or None.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    what: str
    consequence: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.consequence}. Fix: {self.fix}"


@dataclass(frozen=True)
class Compiler:
    path: str
    version: str
    major: int


def _run(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout + out.stderr if out.returncode == 0 else None


def _version(text: str, pattern: str) -> tuple[str, int] | None:
    m = re.search(pattern, text)
    if not m:
        return None
    return m.group(1), int(m.group(1).split(".")[0])


def find_cxx() -> Compiler | None:
    """The host C++ compiler: $CXX, then c++, g++, clang++ on PATH."""
    candidates = [os.environ.get("CXX")] if os.environ.get("CXX") else []
    candidates += ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        text = _run([path, "--version"]) if path else None
        if text:
            ver = _version(text, r"(\d+\.\d+(?:\.\d+)?)") or ("0", 0)
            return Compiler(path, ver[0], ver[1])
    return None


def cuda_home_candidates() -> list[Path]:
    """$CUDA_HOME / $CUDA_PATH, the toolkit owning the nvcc on PATH, then /usr/local/cuda."""
    out = [Path(p) for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    on_path = shutil.which("nvcc")
    if on_path:
        out.append(Path(on_path).resolve().parent.parent)
    out.append(Path("/usr/local/cuda"))
    return out


def find_nvcc() -> tuple[Compiler, Path] | None:
    """(nvcc, CUDA_HOME) for a real toolkit folder (one that holds the static CUDA runtime).

    NOTE: an `nvcc` on PATH may be a wrapper script; its folder is then not the toolkit, so a
    candidate only counts when lib64/libcudart_static.a sits beside bin/nvcc.
    """
    for home in cuda_home_candidates():
        nvcc = home / "bin" / "nvcc"
        if not nvcc.is_file() or not (home / "lib64" / "libcudart_static.a").exists():
            continue
        text = _run([str(nvcc), "--version"])
        ver = _version(text or "", r"release (\d+\.\d+)")
        if ver:
            return Compiler(str(nvcc), ver[0], ver[1]), home
    return None


class ToolchainError(RuntimeError):
    """A compiler the user named explicitly cannot be used."""


def _hip_clang_at(name: str) -> Compiler | None:
    path = shutil.which(name) or (name if os.path.isfile(name) else None)
    text = _run([path, "--version"]) if path else None
    ver = _version(text or "", r"clang version (\d+\.\d+(?:\.\d+)?)")
    return Compiler(path, ver[0], ver[1]) if ver and ver[1] >= 17 else None


def find_hip_clang(override: str | None = None) -> Compiler | None:
    """A clang able to compile HIP (LLVM >= 17 knows gfx1151 and gfx1201).

    `override` is FREETOKEN_HIP_CLANG's value (callers read it): used alone, and an unusable
    one raises ToolchainError naming the variable. Otherwise hipcc's clang, then clang-19/18/17
    or clang on PATH.
    """
    if override:
        found = _hip_clang_at(override)
        if found is None:
            raise ToolchainError(f"FREETOKEN_HIP_CLANG={override!r} is not a clang >= 17 that "
                                 "runs here; point it at a HIP-capable clang (e.g. "
                                 "/opt/rocm/llvm/bin/clang++ or clang-19) or unset it")
        return found
    for name in ("/opt/rocm/llvm/bin/clang++", "clang++-19", "clang-19", "clang++-18", "clang-18",
                 "clang++-17", "clang-17", "clang++", "clang"):
        if found := _hip_clang_at(name):
            return found
    return None


def check_cuda_match(nvcc: Compiler | None, torch_cuda: str | None,
                     allow_mismatch: bool = False) -> Problem | None:
    """nvcc's major must equal torch's CUDA major: a kernel built by nvcc N needs CUDA N's runtime."""
    if nvcc is None or not torch_cuda:
        return None
    torch_major = int(torch_cuda.split(".")[0])
    if nvcc.major == torch_major or allow_mismatch:
        return None
    return Problem(
        what=f"nvcc {nvcc.version} ({nvcc.path}) does not match torch's CUDA {torch_cuda}",
        consequence=(f"kernels it builds expect the CUDA {nvcc.major} runtime and driver, "
                     f"while torch ships CUDA {torch_major}; they may fail to load or launch"),
        fix=(f"point CUDA_HOME at a CUDA {torch_major}.x toolkit, or install the torch build for "
             f"CUDA {nvcc.major}; set FREETOKEN_ALLOW_CUDA_MISMATCH=1 to build anyway"),
    )


def check_hip_match(clang: Compiler | None, torch_hip: str | None) -> Problem | None:
    """HIP builds need ROCm >= 6 at run time; torch's HIP version tells what the machine runs."""
    if not torch_hip:
        return None
    major = int(torch_hip.split(".")[0])
    if clang is None:
        return Problem(
            what=f"torch is built for HIP {torch_hip} but no HIP-capable clang was found",
            consequence="ROCm kernels cannot be compiled on this machine (JIT unavailable)",
            fix="install ROCm's hipcc (/opt/rocm) or clang >= 17, or use the cache wheel",
        )
    if major < 6:
        return Problem(
            what=f"torch's HIP {torch_hip} is older than ROCm 6",
            consequence="gfx1151/gfx1201 kernels need ROCm >= 6 to run",
            fix="install a torch build for ROCm 6 or newer",
        )
    return None


def check_host_compiler(cxx: Compiler | None) -> Problem | None:
    if cxx is not None:
        return None
    return Problem(
        what="no host C++ compiler (c++, g++, clang++ or $CXX) on PATH",
        consequence="CPU kernels missing from the cache cannot be compiled on this machine",
        fix="install the freetoken-kernel-cache wheel for this runtime, or a C++ compiler "
            "(e.g. `apt-get install g++`)",
    )
