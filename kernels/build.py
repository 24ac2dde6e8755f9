"""How a registry kernel is built: the one place that knows flags, keys and the ninja graph.

Used by the cache-wheel backend (ahead of time) and by the runtime's JIT fallback. Stdlib only;
loaded by file path (``load_by_path``) so the backend never imports freetoken.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent

# Bumped when the flags below change meaning, so every key changes with them.
BUILD_FORMAT = 2

# Every .so must run on glibc 2.28 (the cache wheel's manylinux_2_28 tag) wherever it is built:
# libstdc++ is static (no GLIBCXX requirement), libgcc_s stays shared (its static unwinder calls
# _dl_find_object, glibc 2.35), and compat/glibc_compat.cc pins the glibc symbols that static
# libstdc++ and the static CUDA runtime reference to their old versions. Before glibc 2.34 those
# live in libpthread, libdl and librt, hence the explicit (stub, on newer glibc) dependencies.
COMPAT_SOURCE = "compat/glibc_compat.cc"
COMPAT_LIBS = ("-Wl,--push-state,--no-as-needed", "-l:libpthread.so.0", "-l:libdl.so.2",
               "-l:librt.so.1", "-Wl,--pop-state")

CPU_FLAGS = (
    "-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-pthread",
    "-march=x86-64", "-mtune=generic", "-fno-math-errno",
)
CPU_LDFLAGS = ("-static-libstdc++", "-Wl,--no-undefined") + COMPAT_LIBS
CUDA_FLAGS = (
    "-O3", "-std=c++17", "-shared", "--expt-relaxed-constexpr", "-cudart=static",
    "-Xcompiler=-fPIC,-fvisibility=hidden,-static-libstdc++",
    "-Xlinker=--no-undefined", "--threads=2",
)
CUDA_LDFLAGS = ("-Xlinker=" + ",".join(f.removeprefix("-Wl,") for f in COMPAT_LIBS),)
ROCM_FLAGS = (
    "-O3", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-x", "hip",
    "-nogpulib", "-nogpuinc", "-no-hip-rt", "-D__HIP_PLATFORM_AMD__",
)
ROCM_LDFLAGS = ("-static-libstdc++",) + COMPAT_LIBS


def cuda_gencode(target: str) -> str:
    """sm_XY[a|f] -> SASS for that arch; compute_XY -> PTX only (JIT-compiled by the driver)."""
    m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", target)
    if not m:
        raise ValueError(f"not a CUDA target: {target!r}")
    kind, arch, suffix = m.groups()
    code = f"compute_{arch}{suffix}" if kind == "compute" else f"sm_{arch}{suffix}"
    return f"arch=compute_{arch}{suffix},code={code}"


def load_by_path(name: str, path: Path):
    """Import a stdlib-only module from a file without touching sys.path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_registry():
    """The registry module, one copy per process: build.py is the only place that loads it,
    whether imported as freetoken.csrc.build (the runtime) or by path (the cache backend).
    Inside the runtime package it is also what `freetoken.csrc.registry` names."""
    names = ["freetoken_kernel_registry"] + (["freetoken.csrc.registry"]
                                             if __package__ == "freetoken.csrc" else [])
    module = next((sys.modules[n] for n in names if n in sys.modules), None)
    module = module or load_by_path(names[0], KERNELS_DIR / "registry.py")
    for name in names:
        sys.modules.setdefault(name, module)
    return module


registry = _load_registry()


@dataclass(frozen=True)
class Toolchain:
    """Compilers and tvm-ffi paths used to build; any compiler may be None (target skipped)."""

    tvm_include: tuple[str, ...]
    tvm_libdir: str
    cxx: str | None = None
    nvcc: str | None = None
    hip_clang: str | None = None
    cuda_major: int | None = None


@dataclass(frozen=True)
class BuildJob:
    kernel: str
    variant: str
    target: str
    key: str
    sources: tuple[str, ...]
    output: str  # relative to the cache root: <target>/<key>.so


def abi_tag(backend: str, cuda_major: int | None) -> str:
    """The part of the toolchain a key depends on (a CUDA .so is tied to its toolkit major)."""
    if backend == "cuda":
        return f"cuda{cuda_major}"
    return backend


_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def included_headers(sources: list[Path], backend: str) -> list[Path]:
    """Every header of this tree that `sources` include, transitively (shims too for ROCm)."""
    roots = [KERNELS_DIR / "include"] + ([KERNELS_DIR / "hip"] if backend == "rocm" else [])
    seen: dict[Path, None] = {}
    pending = list(sources)
    while pending:
        text = pending.pop().read_text(errors="replace")
        for name in _INCLUDE.findall(text):
            for root in roots:
                # normpath, not resolve(): the tree has no symlinks, and resolving every include
                # line (system headers too) cost ~40 ms of each start-up's cache look-ups
                path = Path(os.path.normpath(root / name))
                if path not in seen and path.is_file():
                    seen[path] = None
                    pending.append(path)
    return sorted(seen)


def kernel_key(kernel, variant, backend: str, cuda_major: int | None = None) -> str:
    """name-variant-hash; the hash covers sources, the headers they include, flags and ABI tag."""
    h = hashlib.sha256()
    h.update(f"format={BUILD_FORMAT};abi={abi_tag(backend, cuda_major)};".encode())
    h.update(repr(variant.defines).encode())
    h.update(repr(_flags_for_backend(backend)).encode())
    sources = [KERNELS_DIR / rel for rel in kernel.sources_for(backend)]
    for rel, path in zip(kernel.sources_for(backend), sources):
        h.update(rel.encode())
        h.update(path.read_bytes())
    for header in included_headers(sources, backend) + [KERNELS_DIR / COMPAT_SOURCE]:
        h.update(str(header.relative_to(KERNELS_DIR)).encode())
        h.update(header.read_bytes())
    return f"{kernel.name}-{variant.name}-{h.hexdigest()[:16]}"


def _flags_for_backend(backend: str) -> tuple[str, ...]:
    return {"cpu": CPU_FLAGS + CPU_LDFLAGS, "cuda": CUDA_FLAGS + CUDA_LDFLAGS,
            "rocm": ROCM_FLAGS + ROCM_LDFLAGS}[backend]


def jobs_for(targets, cuda_major: int | None, kernels=None) -> list[BuildJob]:
    """Every (kernel, variant, target) the registry asks for among `targets`."""
    jobs = []
    for kernel in kernels or registry.KERNELS:
        for target in kernel.targets():
            if target not in targets:
                continue
            backend = registry.backend_of(target)
            for variant in kernel.variants:
                key = kernel_key(kernel, variant, backend, cuda_major)
                jobs.append(BuildJob(kernel.name, variant.name, target, key,
                                     kernel.sources_for(backend), f"{target}/{key}.so"))
    return jobs


def compile_command(job: BuildJob, out_path: Path, tc: Toolchain) -> list[str]:
    """The full compiler argv that turns one job's sources into one shared object."""
    kernel = registry.KERNELS_BY_NAME[job.kernel]
    variant = next(v for v in kernel.variants if v.name == job.variant)
    backend = registry.backend_of(job.target)
    sources = [str(KERNELS_DIR / s) for s in job.sources]
    includes = [f"-I{KERNELS_DIR / 'include'}"] + [f"-I{p}" for p in tc.tvm_include]
    defines = [f"-D{k}={v}" for k, v in variant.defines]
    defines.append(f"-DFREETOKEN_KERNEL_NAME={kernel.name}")
    link = [f"-L{tc.tvm_libdir}", "-ltvm_ffi"]
    compat = str(KERNELS_DIR / COMPAT_SOURCE)
    if backend == "cpu":
        return [tc.cxx, *CPU_FLAGS, *includes, *defines, *sources, compat, "-o", str(out_path),
                *link, *CPU_LDFLAGS]
    if backend == "cuda":
        return [tc.nvcc, *CUDA_FLAGS, f"-gencode={cuda_gencode(job.target)}", *includes,
                *defines, *sources, compat, "-o", str(out_path), *link, *CUDA_LDFLAGS]
    hip_includes = [f"-I{KERNELS_DIR / 'hip'}"]
    # The .so is checked (bundler, readelf) but not linked against a HIP runtime here:
    # no ROCm runtime exists on the build machines, so HIP symbols resolve at load on the device.
    # The compat source is host C++ (`-x c++`), not a HIP input.
    return [tc.hip_clang, *ROCM_FLAGS, f"--offload-arch={job.target}", *hip_includes, *includes,
            *defines, *sources, "-x", "c++", compat, "-o", str(out_path), *link, *ROCM_LDFLAGS]


def write_ninja(jobs: list[BuildJob], out_root: Path, tc: Toolchain, ninja_path: Path) -> None:
    """One ninja file for all jobs; each edge writes its .so atomically via a temp name."""
    lines = ["ninja_required_version = 1.3", f"builddir = {_ninja_escape(str(out_root))}", "rule cc", "  command = $cmd && mv -f $out.tmp $out",
             "  description = $desc", ""]
    for job in jobs:
        out = out_root / job.output
        cmd = compile_command(job, Path(str(out) + ".tmp"), tc)
        deps = " ".join(_ninja_escape(str(KERNELS_DIR / s)) for s in job.sources)
        lines.append(f"build {_ninja_escape(str(out))}: cc {deps}")
        lines.append(f"  cmd = {shlex.join(cmd)}")
        lines.append(f"  desc = {job.target} {job.kernel}[{job.variant}]")
    ninja_path.write_text("\n".join(lines) + "\n")


def _ninja_escape(s: str) -> str:
    return s.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def run_ninja(ninja_file: Path, jobs: int | None = None, quiet: bool = False) -> None:
    """Run ninja (the pip package's binary or one on PATH); progress lines go to stderr."""
    ninja = _find_ninja()
    cmd = [ninja, "-f", str(ninja_file)]
    if jobs:
        cmd += ["-j", str(jobs)]
    result = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else sys.stderr,
                            stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        detail = result.stdout[-4000:] if quiet and result.stdout else "(see the output above)"
        raise RuntimeError(f"kernel build failed (ninja exit {result.returncode}): {detail}")


def _find_ninja() -> str:
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError:
        pass
    from shutil import which

    found = which("ninja")
    if not found:
        raise RuntimeError("ninja not found: `pip install ninja`")
    return found
