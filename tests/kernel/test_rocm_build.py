"""The ROCm kernels build through the HIP shim with plain clang and carry gfx code objects.

No AMD GPU or ROCm install is needed (nor available): the test compiles every rocm=True kernel
with kernels/build.py's exact command and reads the offload bundle inside the shared object.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from freetoken.csrc import build
from tests.kernel.prebuilt import prebuilt_objects

# Every kernel a GPU serves (the CUDA set) must have a HIP build too.
GPU_KERNELS = tuple(k.name for k in build.registry.KERNELS if k.cuda)
ROCM_KERNELS = tuple(k.name for k in build.registry.KERNELS
                     if set(k.targets()) & set(build.registry.ROCM_TARGETS))


def test_rocm_targets_cover_the_cuda_kernel_set():
    registry = build.registry
    for target in registry.ROCM_TARGETS + registry.CUDA_TARGETS:
        covered = {k.name for k in registry.KERNELS if target in k.targets()}
        assert covered == set(GPU_KERNELS), f"{target} covers {sorted(covered)}"
    assert "attention" in ROCM_KERNELS and "sampling" in ROCM_KERNELS


def _tool(name: str) -> str | None:
    return shutil.which(f"{name}-19") or shutil.which(name)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{(kernel, target): .so path} for every rocm kernel and ROCm target: the cache wheel
    under test's objects where it holds them all (tests/kernel/prebuilt.py), else compiled."""
    jobs = build.jobs_for(build.registry.ROCM_TARGETS, None)
    out_dir = tmp_path_factory.mktemp("rocm")
    prebuilt = prebuilt_objects(jobs, out_dir)
    if prebuilt is not None:
        return {(job.kernel, job.target): path for job, path in prebuilt}
    clang = shutil.which("clang-19")
    if clang is None:
        pytest.skip("clang-19 is not installed")
    import tvm_ffi.libinfo as libinfo

    tc = build.Toolchain(
        tvm_include=(libinfo.find_include_path(), libinfo.find_dlpack_include_path()),
        tvm_libdir=str(Path(libinfo.find_libtvm_ffi()).parent), hip_clang=clang)

    def compile_one(job):
        out = out_dir / f"{job.kernel}-{job.target}.so"
        done = subprocess.run(build.compile_command(job, out, tc), capture_output=True, text=True)
        assert done.returncode == 0, f"{job.kernel} for {job.target}:\n{done.stderr[-4000:]}"
        return (job.kernel, job.target), out

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(compile_one, jobs))


def test_registry_rocm_kernels_match(built):
    assert {k for k, _ in built} == set(ROCM_KERNELS)
    assert {t for _, t in built} == {"gfx1151", "gfx1201"}


def _bundle_targets(so: Path, scratch: Path) -> str:
    """The offload bundle's entries, read from the .hip_fatbin section of the shared object."""
    objcopy, bundler = _tool("llvm-objcopy"), _tool("clang-offload-bundler")
    if objcopy is None or bundler is None:
        pytest.skip("llvm-objcopy-19 / clang-offload-bundler-19 are not installed")
    fatbin = scratch / (so.stem + ".hipfb")
    subprocess.run([objcopy, f"--dump-section=.hip_fatbin={fatbin}", str(so), str(scratch / "x")],
                   check=True, capture_output=True)
    listed = subprocess.run([bundler, "--list", "--type=o", f"--input={fatbin}"], check=True,
                            capture_output=True, text=True)
    return listed.stdout


@pytest.mark.parametrize("kernel", ROCM_KERNELS)
def test_offload_bundle_holds_the_gfx_target(built, kernel, tmp_path):
    for target in ("gfx1151", "gfx1201"):
        entries = _bundle_targets(built[(kernel, target)], tmp_path)
        assert f"amdgcn-amd-amdhsa--{target}" in entries, entries
        other = "gfx1201" if target == "gfx1151" else "gfx1151"
        assert other not in entries  # one .so per target, as the registry keys them


@pytest.mark.parametrize("kernel", ROCM_KERNELS)
def test_exports_and_hip_runtime_imports(built, kernel):
    so = built[(kernel, "gfx1201")]
    nm = _tool("llvm-nm")
    if nm is None:
        pytest.skip("llvm-nm-19 is not installed")
    symbols = subprocess.run([nm, "-D", str(so)], check=True, capture_output=True,
                             text=True).stdout
    functions = build.registry.KERNELS_BY_NAME[kernel].functions
    for fn in functions:
        assert f" T __tvm_ffi_{fn}" in symbols
    # Launches go through the HIP runtime (resolved on a ROCm machine), never the device libs.
    assert " U hipLaunchKernel" in symbols and "__ocml" not in symbols
