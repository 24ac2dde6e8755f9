"""JIT fallback: build one registry kernel for this device, privately, then publish atomically."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from freetoken.csrc import build
from freetoken.env import Env
from freetoken.kernel.errors import KernelBuildError, KernelUnavailable
from freetoken.toolchain import checks

log = logging.getLogger(__name__)


def toolchain_for(backend: str, env: Env) -> build.Toolchain:
    """Find the compiler for `backend` and run its checks; KernelUnavailable names the fix."""
    from freetoken.arrays import import_tvm_ffi

    libinfo = import_tvm_ffi().libinfo
    tvm = dict(tvm_include=(libinfo.find_include_path(), libinfo.find_dlpack_include_path()),
               tvm_libdir=str(Path(libinfo.find_libtvm_ffi()).parent))
    if backend == "cpu":
        cxx = checks.find_cxx()
        if problem := checks.check_host_compiler(cxx):
            raise KernelUnavailable(str(problem))
        return build.Toolchain(cxx=cxx.path, **tvm)
    if backend == "cuda":
        found = checks.find_nvcc()
        if found is None:
            raise KernelUnavailable("no CUDA toolkit (nvcc with its static runtime) was found: "
                                    "set CUDA_HOME to the toolkit folder, or install the "
                                    "freetoken-kernel-cache wheel")
        nvcc, _home = found
        import torch

        problem = checks.check_cuda_match(nvcc, torch.version.cuda, env.allow_cuda_mismatch)
        if problem:
            raise KernelUnavailable(str(problem))
        return build.Toolchain(nvcc=nvcc.path, cuda_major=nvcc.major, **tvm)
    import torch

    try:
        clang = checks.find_hip_clang(env.hip_clang)
    except checks.ToolchainError as exc:
        raise KernelUnavailable(str(exc)) from None
    if problem := checks.check_hip_match(clang, getattr(torch.version, "hip", None)):
        raise KernelUnavailable(str(problem))
    return build.Toolchain(hip_clang=clang.path, **tvm)


def jit_build(job: build.BuildJob, tc: build.Toolchain, jit_dir: Path) -> Path:
    """Return jit_dir/<target>/<key>.so, compiling it first if no process has published it.

    The compile runs in a stage folder private to this host and process; `os.link` publishes
    it, and the first writer wins, so concurrent builders all end with one complete file.
    """
    final = jit_dir / job.output
    if final.exists():
        return final
    stage_root = jit_dir / ".stage"
    stage_root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f"{socket.gethostname()}-{os.getpid()}-",
                                  dir=stage_root))
    try:
        staged = stage / f"{job.key}.so"
        cmd = build.compile_command(job, staged, tc)
        log.info("compiling kernel %s for %s (not in the kernel cache) ...", job.kernel,
                    job.target)
        env = dict(os.environ)
        if tc.nvcc:
            env["CUDA_HOME"] = str(Path(tc.nvcc).parent.parent)
        result = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling kernel {job.kernel} for {job.target} failed:\n"
                                   f"{' '.join(cmd)}\n{(result.stderr or result.stdout)[-6000:]}")
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(staged, final)
        except FileExistsError:
            pass  # another process published first; its file is complete
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return final
