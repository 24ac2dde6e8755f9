"""PEP 517 backend of freetoken-kernel-cache: compile the registry, then pack a wheel.

It loads kernels/build.py, toolchain/checks.py and runtime/freetoken/env.py by path (stdlib
only), so building never imports the freetoken runtime.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kernel-cache" / "freetoken_kernel_cache"
NAME = "freetoken_kernel_cache"
TVM_FFI_RANGE = ">=0.1.0,<0.2"


def _load(name: str, rel: str):
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


build = _load("freetoken_kernel_build", "kernels/build.py")
checks = _load("freetoken_toolchain_checks", "toolchain/checks.py")
elf_versions = _load("freetoken_toolchain_elf_versions", "toolchain/elf_versions.py")
ft_env = _load("freetoken_env_standalone", "runtime/freetoken/env.py")
registry = build.registry


def runtime_version() -> str:
    text = (REPO / "runtime" / "freetoken" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def _say(msg: str) -> None:
    print(f"[freetoken-kernel-cache] {msg}", file=sys.stderr, flush=True)


def select_targets(requested: tuple[str, ...], hip_clang: str | None = None
                   ) -> tuple[list[str], dict]:
    """Targets to build and the toolchain facts; default = every target whose compiler exists.
    `hip_clang` is FREETOKEN_HIP_CLANG (an unusable one is an error, not a skipped target)."""
    cxx, nvcc, clang = checks.find_cxx(), checks.find_nvcc(), checks.find_hip_clang(hip_clang)
    present = {"cpu": cxx is not None, "cuda": nvcc is not None, "rocm": clang is not None}
    groups = {"cpu": list(registry.CPU_TARGETS), "cuda": list(registry.CUDA_TARGETS),
              "rocm": list(registry.ROCM_TARGETS)}
    if not requested:
        targets = [t for g, ts in groups.items() if present[g] for t in ts]
    else:
        targets = []
        for name in requested:
            if name == "all":
                targets += [t for ts in groups.values() for t in ts]
            elif name in groups:
                targets += groups[name]
            elif name in registry.ALL_TARGETS:
                targets.append(name)
            else:
                raise ValueError(f"FREETOKEN_CACHE_TARGETS names unknown target {name!r}; known: "
                                 f"cpu, cuda, rocm, all, {', '.join(registry.ALL_TARGETS)}")
    targets = list(dict.fromkeys(targets))
    for group in {registry.backend_of(t) for t in targets}:
        if not present[group]:
            raise RuntimeError(f"cannot build {group} targets: no compiler found "
                               f"({checks.check_host_compiler(None) if group == 'cpu' else group})")
    facts = {"cxx": cxx, "nvcc": nvcc[0] if nvcc else None, "cuda_home": nvcc[1] if nvcc else None,
             "hip_clang": clang}
    return targets, facts


def _check_cuda_against_torch(nvcc, allow: bool) -> None:
    try:
        import torch
    except ImportError:
        return  # building in isolation: the wheel's +cuNNN tag carries the toolkit major
    problem = checks.check_cuda_match(nvcc, torch.version.cuda, allow)
    if problem:
        raise RuntimeError(str(problem))


def compile_all(targets: list[str], facts: dict, objects: Path, jobs: int) -> list:
    """Compile every job into `objects` (kept between builds: ninja skips existing keys)."""
    import tvm_ffi.libinfo as libinfo

    nvcc = facts["nvcc"]
    tc = build.Toolchain(
        tvm_include=(libinfo.find_include_path(), libinfo.find_dlpack_include_path()),
        tvm_libdir=str(Path(libinfo.find_libtvm_ffi()).parent),
        cxx=facts["cxx"].path if facts["cxx"] else None,
        nvcc=nvcc.path if nvcc else None,
        hip_clang=facts["hip_clang"].path if facts["hip_clang"] else None,
        cuda_major=nvcc.major if nvcc else None,
    )
    build_jobs = build.jobs_for(set(targets), tc.cuda_major)
    for target in targets:
        (objects / target).mkdir(parents=True, exist_ok=True)
    # Keys hash sources, headers, flags and toolchain: an existing object is already right,
    # wherever the tree it came from lived.
    missing = [job for job in build_jobs if not (objects / job.output).is_file()]
    ninja_file = objects / f"build-{os.getpid()}.ninja"
    build.write_ninja(missing, objects, tc, ninja_file)
    if facts["cuda_home"]:
        os.environ["CUDA_HOME"] = str(facts["cuda_home"])
    _say(f"{len(missing)} of {len(build_jobs)} kernel builds to compile for "
         f"{', '.join(targets)} (objects in {objects})")
    start = time.perf_counter()
    try:
        build.run_ninja(ninja_file, jobs or None)
    finally:
        ninja_file.unlink(missing_ok=True)
    _say(f"compiled in {time.perf_counter() - start:.1f} s")
    return build_jobs


def write_index(out_root: Path, build_jobs: list, targets: list[str], version: str,
                facts: dict) -> dict:
    kernels: dict = {}
    for job in build_jobs:
        kernel = registry.KERNELS_BY_NAME[job.kernel]
        entry = kernels.setdefault(job.key, {"kernel": job.kernel, "variant": job.variant,
                                             "functions": list(kernel.functions_for(
                                                 registry.backend_of(job.target))),
                                             "targets": {}})
        path = out_root / job.output
        entry["targets"][job.target] = {"file": job.output,
                                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    index = {
        "format": 1,
        "freetoken_version": version,
        "tvm_ffi": TVM_FFI_RANGE,
        "cuda": facts["nvcc"].version if facts["nvcc"] and any(
            registry.backend_of(t) == "cuda" for t in targets) else None,
        "rocm": f"clang {facts['hip_clang'].version}" if facts["hip_clang"] and any(
            registry.backend_of(t) == "rocm" for t in targets) else None,
        "targets": targets,
        "kernels": kernels,
    }
    (out_root / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


def cache_version(base: str, targets: list[str], facts: dict) -> str:
    """Runtime version plus a local tag: +cu130 when CUDA targets are in, then the g-stamp."""
    public, _, local = base.partition("+")
    parts = []
    if any(registry.backend_of(t) == "cuda" for t in targets):
        major, minor = facts["nvcc"].version.split(".")[:2]
        parts.append(f"cu{major}{minor}")
    parts += [p for p in local.split(".") if p]
    return f"{public}+{'.'.join(parts or ['cpu'])}"


def platform_tag(so_files: list[Path]) -> str:
    """manylinux_2_28_x86_64 when every object keeps to that policy (kernels/build.py links
    them so), else the honest manylinux_2_N of the newest glibc they need, saying why."""
    needs = {path: elf_versions.needed_versions(path) for path in so_files}
    newest = max([elf_versions.newest_glibc(n) for n in needs.values()] + [(2, 28)])
    for path, need in needs.items():
        for n in elf_versions.too_new(need):
            _say(f"WARNING: {path.name} needs {n.symbol}@{n.version} ({n.library}), newer than "
                 "manylinux_2_28 allows")
    return f"manylinux_{newest[0]}_{newest[1]}_x86_64"


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def _metadata(version: str) -> str:
    return (f"Metadata-Version: 2.1\nName: freetoken-kernel-cache\nVersion: {version}\n"
            "Summary: Ahead-of-time compiled kernels for the freetoken runtime\n"
            "Requires-Python: >=3.10\n")


def pack_wheel(stage: Path, wheel_directory: Path, version: str, tag: str) -> str:
    """Zip stage/<package> into a wheel with METADATA, WHEEL and RECORD."""
    dist_info = f"{NAME}-{version}.dist-info"
    wheel_name = f"{NAME}-{version}-py3-none-{tag}.whl"
    metadata = _metadata(version)
    wheel_meta = (f"Wheel-Version: 1.0\nGenerator: freetoken_cache_backend\n"
                  f"Root-Is-Purelib: false\nTag: py3-none-{tag}\n")
    records = []
    path = wheel_directory / wheel_name
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for file in sorted(p for p in stage.rglob("*") if p.is_file()):
            arcname = file.relative_to(stage).as_posix()
            data = file.read_bytes()
            zf.writestr(arcname, data)
            records.append(_record_line(arcname, data))
        for name, text in (("METADATA", metadata), ("WHEEL", wheel_meta)):
            arcname = f"{dist_info}/{name}"
            zf.writestr(arcname, text)
            records.append(_record_line(arcname, text.encode()))
        records.append(f"{dist_info}/RECORD,,")
        zf.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return wheel_name


def build_cache(out_dir: Path, env=None) -> tuple[str, list[str], dict]:
    """Compile into out_dir/<package>/cache; return (version, targets, facts)."""
    env = env or ft_env.read()
    targets, facts = select_targets(env.cache_targets, env.hip_clang)
    if any(registry.backend_of(t) == "cuda" for t in targets):
        _check_cuda_against_torch(facts["nvcc"], env.allow_cuda_mismatch)
    package = out_dir / NAME
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__", "cache"))
    out_root = package / "cache"
    objects = env.build_dir or REPO / "kernel-cache" / "build" / "objects"
    build_jobs = compile_all(targets, facts, objects, env.build_jobs)
    for job in build_jobs:
        (out_root / job.target).mkdir(parents=True, exist_ok=True)
        shutil.copy2(objects / job.output, out_root / job.output)
    version = cache_version(runtime_version(), targets, facts)
    write_index(out_root, build_jobs, targets, version, facts)
    init = package / "__init__.py"
    init.write_text(init.read_text().replace('"0+unbuilt"', f'"{version}"'))
    return version, targets, facts


# PEP 517 hooks -----------------------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    """Metadata without compiling: the version only depends on which targets will be built."""
    env = ft_env.read()
    targets, facts = select_targets(env.cache_targets, env.hip_clang)
    version = cache_version(runtime_version(), targets, facts)
    dist_info = Path(metadata_directory) / f"{NAME}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(_metadata(version))
    return dist_info.name


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with tempfile.TemporaryDirectory(prefix="freetoken-cache-") as tmp:
        stage = Path(tmp)
        version, targets, _ = build_cache(stage)
        tag = platform_tag(sorted(stage.rglob("*.so")))
        name = pack_wheel(stage, Path(wheel_directory), version, tag)
    _say(f"built {name} ({', '.join(targets)})")
    return name
