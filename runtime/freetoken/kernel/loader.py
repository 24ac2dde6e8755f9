"""Find, check and load a registry kernel for a device: cache first, JIT only where allowed.

Look-up order: the kernel cache (FREETOKEN_KERNEL_CACHE_DIR or the installed wheel; paired
with this runtime; best target for the device; sha256 checked), then an earlier JIT build,
then a JIT compile unless FREETOKEN_DISABLE_JIT is set, in which case KernelUnavailable.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken import __version__, env as ft_env
from freetoken.csrc import build
from freetoken.kernel import cache as kcache
from freetoken.kernel.errors import KernelCacheError, KernelUnavailable
from freetoken.kernel.targets import (DeviceSpec, device_parts, device_spec, jit_target,
                                      rank_targets)

log = logging.getLogger(__name__)
_lock = threading.RLock()
_modules: dict[tuple, object] = {}
_functions: dict[tuple, object] = {}


@dataclass(frozen=True)
class Resolution:
    """Where a kernel comes from on a device: cache | jit-cached | jit | unavailable."""

    kernel: str
    key: str
    source: str
    target: str
    path: Path | None = None
    reason: str = ""


def kernel_key_for(kernel: str, spec: DeviceSpec, variant: str = "default") -> str:
    k = build.registry.KERNELS_BY_NAME[kernel]
    v = next((x for x in k.variants if x.name == variant), None)
    if v is None:
        raise KeyError(f"kernel {kernel!r} has no variant {variant!r}")
    cuda = torch_cuda_version(spec)
    return build.kernel_key(k, v, spec.backend, int(cuda.split(".")[0]) if cuda else None)


def torch_cuda_version(spec: DeviceSpec) -> str | None:
    """torch's CUDA version where it matters (GPU kernels); CPU look-ups never import torch."""
    if spec.backend == "cpu":
        return None
    import torch

    return torch.version.cuda


def _cache_index(env: ft_env.Env, spec: DeviceSpec) -> tuple[kcache.CacheIndex | None, str]:
    """The usable cache index, or None and the reason it is refused / absent."""
    root = kcache.locate_cache(env)
    if root is None:
        return None, ("the kernel cache is disabled (FREETOKEN_DISABLE_KERNEL_CACHE)"
                      if env.disable_kernel_cache
                      else "no freetoken-kernel-cache wheel is installed")
    index = kcache.load_index(root)
    problem = kcache.pairing_problem(index.version, __version__, torch_cuda_version(spec))
    return (None, problem) if problem else (index, "")


def resolve(kernel: str, spec: DeviceSpec, variant: str = "default",
            env: ft_env.Env | None = None, verify: bool = True) -> Resolution:
    """Decide where `kernel` comes from on `spec` without compiling anything."""
    env = env or ft_env.read()
    key = kernel_key_for(kernel, spec, variant)
    k = build.registry.KERNELS_BY_NAME[kernel]
    if spec.backend not in {build.registry.backend_of(t) for t in k.targets()}:
        return Resolution(kernel, key, "unavailable", str(spec),
                          reason=f"kernel {kernel} is not built for {spec.backend}")
    index, why = _cache_index(env, spec)
    if index is not None:
        for target in rank_targets(index.targets_for(key), spec):
            entry = index.entry(key, target)
            path = index.root / entry["file"]
            if verify and (not path.is_file() or kcache.sha256_file(path) != entry["sha256"]):
                why = f"{path} is missing or its sha256 does not match the cache index"
                break
            return Resolution(kernel, key, "cache", target, path)
        else:
            why = (f"the cache ({index.version}) has no {kernel} build for {spec}; "
                   f"its targets: {', '.join(index.targets_for(key)) or 'none for this kernel'}")
    target = jit_target(spec)
    jit_path = env.jit_dir / target / f"{key}.so"
    if jit_path.is_file():
        return Resolution(kernel, key, "jit-cached", target, jit_path)
    if env.disable_jit:
        return Resolution(kernel, key, "unavailable", target, reason=why)
    return Resolution(kernel, key, "jit", target, reason=why)


def describe_cache(env: ft_env.Env) -> str:
    """The kernel cache in a few words: disabled, not installed, or its version and targets."""
    if env.disable_kernel_cache:
        return "disabled (FREETOKEN_DISABLE_KERNEL_CACHE is set)"
    root = kcache.locate_cache(env)
    if root is None:
        return "none installed"
    try:
        idx = kcache.load_index(root)
    except KernelCacheError as exc:
        return str(exc)
    return f"{idx.version} at {root} (targets: {', '.join(idx.targets) or 'none'})"


def unavailable_message(res: Resolution, env: ft_env.Env) -> str:
    """Why a kernel cannot load here, with the fix, on one line."""
    if env.disable_kernel_cache:
        fix = ("unset FREETOKEN_DISABLE_KERNEL_CACHE (and install the freetoken-kernel-cache "
               "wheel paired with this runtime), or unset FREETOKEN_DISABLE_JIT on a machine "
               "with a compiler")
    else:
        fix = ("install the freetoken-kernel-cache wheel paired with this runtime (same "
               "version and build stamp) that includes this target, or unset "
               "FREETOKEN_DISABLE_JIT on a machine with a compiler")
    return (f"kernel '{res.kernel}' ({res.key}) is unavailable for target {res.target}: "
            f"{res.reason}. Kernel cache: {describe_cache(env)}; runtime: freetoken "
            f"{__version__}; JIT is disabled (FREETOKEN_DISABLE_JIT). Fix: {fix}.")


def get_module(kernel: str, device: Any = "cpu", variant: str = "default"):
    """The loaded tvm-ffi module of `kernel` for `device` (loaded once per process)."""
    spec = device_spec(device)
    with _lock:
        cached = _modules.get((kernel, variant, spec))
        if cached is not None:
            return cached
        env = ft_env.read()
        res = resolve(kernel, spec, variant, env)
        if res.source == "unavailable":
            raise KernelUnavailable(unavailable_message(res, env))
        path = res.path
        if res.source == "jit":
            from freetoken.kernel import jit

            if res.reason:
                log.info("kernel %s: %s", kernel, res.reason)
            tc = jit.toolchain_for(spec.backend, env)
            job = build.BuildJob(kernel, variant, res.target, res.key,
                                 build.registry.KERNELS_BY_NAME[kernel].sources_for(spec.backend),
                                 f"{res.target}/{res.key}.so")
            path = jit.jit_build(job, tc, env.jit_dir)
        from freetoken.arrays import import_tvm_ffi

        module = import_tvm_ffi().load_module(str(Path(path).resolve()))
        _modules[(kernel, variant, spec)] = module
        return module


def get_function(kernel: str, function: str, device: Any = "cpu"):
    """One exported function of a kernel, bound for `device` ("cpu", "cuda:0", a freetoken
    Device or a torch.device; memoized: cheap on hot paths)."""
    memo = (kernel, function, *device_parts(device))
    fn = _functions.get(memo)
    if fn is None:
        backend = device_spec(device).backend
        exported = build.registry.KERNELS_BY_NAME[kernel].functions_for(backend)
        if function not in exported:     # a CPU-only export asked elsewhere, or a typo
            raise KernelUnavailable(f"kernel '{kernel}' has no function '{function}' on "
                                    f"{backend}; it exports {', '.join(exported)} there")
        fn = getattr(get_module(kernel, device), function)
        _functions[memo] = fn
    return fn


def clear_loaded() -> None:
    """Forget loaded modules (tests change the environment between cases)."""
    with _lock:
        _modules.clear()
        _functions.clear()
