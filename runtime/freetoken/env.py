"""Every FREETOKEN_* environment variable, declared once with its type.

Stdlib only: the cache-wheel backend loads this file by path. Read values through ``read()``
(fresh each call, so tests can monkeypatch os.environ); a bad value raises ``EnvError``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off", "")


class EnvError(ValueError):
    """An environment variable holds a value of the wrong type."""


def _bool(name: str, raw: str | None, default: bool) -> bool:
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean; use 1/true/yes or 0/false/no")


def _int(name: str, raw: str | None, default: int, minimum: int = 0) -> int:
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise EnvError(f"{name}={raw!r} must be >= {minimum}")
    return value


def _path(raw: str | None, default: Path | None) -> Path | None:
    if raw is None or raw.strip() == "":
        return default
    return Path(raw).expanduser()


def _list(raw: str | None) -> tuple[str, ...]:
    if raw is None:
        return ()
    return tuple(p.strip() for p in raw.replace(";", ",").split(",") if p.strip())


# Where ci/nightly.sh publishes each pair (under nightly-<sha9>/) and where the root
# engine-manifest.json points: the one place that names the release location.
RELEASE_URL = "https://github.com/FlashML-org/FreeToken/releases/download"


def _default_cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "freetoken"


@dataclass(frozen=True)
class Env:
    """Documented in docs/environment.md's table of environment variables."""

    cache_root: Path            # FREETOKEN_CACHE_ROOT: models, JIT builds
    kernel_cache_dir: Path | None  # FREETOKEN_KERNEL_CACHE_DIR: use this cache folder
    disable_kernel_cache: bool  # FREETOKEN_DISABLE_KERNEL_CACHE
    disable_jit: bool           # FREETOKEN_DISABLE_JIT: a cache miss raises KernelUnavailable
    jit_dir: Path               # FREETOKEN_JIT_DIR
    allow_cuda_mismatch: bool   # FREETOKEN_ALLOW_CUDA_MISMATCH
    cache_targets: tuple[str, ...]  # FREETOKEN_CACHE_TARGETS: cache-wheel build targets
    build_jobs: int             # FREETOKEN_BUILD_JOBS: parallel compiles (0 = ninja's default)
    build_dir: Path | None      # FREETOKEN_BUILD_DIR: compiled objects kept between cache builds
    num_threads: int            # FREETOKEN_NUM_THREADS: CPU kernel threads (0 = all cores)
    home: Path                  # FREETOKEN_HOME: where ci/install.sh puts the venv
    hip_clang: str | None       # FREETOKEN_HIP_CLANG: the clang that compiles HIP (path or name)
    log_level: str              # FREETOKEN_LOG_LEVEL
    release_url: str            # FREETOKEN_RELEASE_URL: where nightly pairs are published
    fused_decode: bool          # FREETOKEN_FUSED_DECODE: fused GPU decode (T <= 4; MoE T <= 8)
    moe_decode: bool            # FREETOKEN_MOE_DECODE: small-step MoE decode kernels (default on)
    quant_gemv: str             # FREETOKEN_QUANT_GEMV: decode GEMV over GGUF/FP8 weights (v1-v3)
    tp_timeout_s: int           # FREETOKEN_TP_TIMEOUT: tensor-parallel collective/hang timeout
    cpu_pack: bool              # FREETOKEN_CPU_PACK: GGUF rows packed 16 wide for AVX-512 VNNI
    driver_copies: bool         # FREETOKEN_DRIVER_COPIES: offloaded experts copied via the driver
    fault_marker: str | None    # FREETOKEN_FAULT_MARKER: tests: fail requests whose prompt has it


VARIABLES = {
    "FREETOKEN_CACHE_ROOT": "user cache folder for models and JIT builds (default ~/.cache/freetoken)",
    "FREETOKEN_KERNEL_CACHE_DIR": "use this kernel-cache folder instead of the installed wheel",
    "FREETOKEN_DISABLE_KERNEL_CACHE": "ignore the kernel cache (1/true/yes)",
    "FREETOKEN_DISABLE_JIT": "never compile: a kernel missing from the cache is an error",
    "FREETOKEN_JIT_DIR": "where JIT-built kernels are kept (default <cache root>/jit)",
    "FREETOKEN_ALLOW_CUDA_MISMATCH": "build CUDA kernels even if nvcc's major differs from torch's",
    "FREETOKEN_CACHE_TARGETS": "cache-wheel targets: names, or cpu/cuda/rocm/all (default: "
                               "every target whose compiler is present)",
    "FREETOKEN_BUILD_JOBS": "parallel compile jobs for cache and JIT builds (0 = ninja default)",
    "FREETOKEN_BUILD_DIR": "where cache builds keep compiled kernels between builds "
                           "(default kernel-cache/build/objects)",
    "FREETOKEN_NUM_THREADS": "threads for CPU kernels (0 = every core)",
    "FREETOKEN_HOME": "install root used by ci/install.sh (default ~/.freetoken)",
    "FREETOKEN_HIP_CLANG": "the clang that compiles ROCm kernels, for cache builds and JIT "
                           "(default: ROCm's, then clang-19/18/17 on PATH)",
    "FREETOKEN_LOG_LEVEL": "logging level (debug, info, warning, error); debug also shows "
                           "tracebacks",
    "FREETOKEN_RELEASE_URL": f"where ci/nightly.sh publishes pairs (default {RELEASE_URL})",
    "FREETOKEN_FUSED_DECODE": "GPU steps of up to 4 tokens run the fused decode kernels "
                              "(default on; off: the unfused cuBLAS chain, for comparison)",
    "FREETOKEN_MOE_DECODE": "MoE layers' 1-token GPU steps run the small-step moe_decode kernels "
                            "(default on; off: the general fused-MoE path)",
    "FREETOKEN_QUANT_GEMV": "decode GEMV over GGUF and FP8 weights: v3 (default: gguf_gemv_q8 "
                            "on int8 activations and the fused decode chain for GGUF and FP8 "
                            "models, gguf_gemv / fp8_gemv for the rest), v2 (gguf_gemv / "
                            "fp8_gemv, 16-byte streaming, bf16 activations) or v1 (gguf_matmul "
                            "/ scaled_gemv), for comparison",
    "FREETOKEN_TP_TIMEOUT": "tensor parallelism: seconds a collective (or a silent rank) may "
                            "take before the server stops, naming the rank (default 60)",
    "FREETOKEN_DRIVER_COPIES": "offloaded experts: 1 launches a miss's host-to-device copies "
                               "and the expert maps through the CUDA driver (cuMemcpyHtoDAsync) "
                               "instead of torch's copy_ (~45 us a copy measured on an H100 "
                               "host; the default until a GPU run has measured the driver's)",
    "FREETOKEN_CPU_PACK": "CPU: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q6_K projections and experts "
                          "are repacked at load, 16 rows wide, on AVX-512 VNNI CPUs (default on; "
                          "off: the GGUF layout, for comparison)",
    "FREETOKEN_FAULT_MARKER": "tests: a request whose prompt contains this text fails inside "
                              "the engine step (fault injection; unset = off)",
}

QUANT_GEMV_VARIANTS = ("v1", "v2", "v3")


def read(environ: dict[str, str] | None = None) -> Env:
    e = os.environ if environ is None else environ
    cache_root = _path(e.get("FREETOKEN_CACHE_ROOT"), None) or _default_cache_root()
    level = e.get("FREETOKEN_LOG_LEVEL", "info").strip().lower() or "info"
    if level not in ("debug", "info", "warning", "error"):
        raise EnvError(f"FREETOKEN_LOG_LEVEL={level!r}; use debug, info, warning or error")
    quant_gemv = e.get("FREETOKEN_QUANT_GEMV", "v3").strip().lower() or "v3"
    if quant_gemv not in QUANT_GEMV_VARIANTS:
        raise EnvError(f"FREETOKEN_QUANT_GEMV={quant_gemv!r}; use v1, v2 or v3")
    return Env(
        cache_root=cache_root,
        kernel_cache_dir=_path(e.get("FREETOKEN_KERNEL_CACHE_DIR"), None),
        disable_kernel_cache=_bool("FREETOKEN_DISABLE_KERNEL_CACHE",
                                   e.get("FREETOKEN_DISABLE_KERNEL_CACHE"), False),
        disable_jit=_bool("FREETOKEN_DISABLE_JIT", e.get("FREETOKEN_DISABLE_JIT"), False),
        jit_dir=_path(e.get("FREETOKEN_JIT_DIR"), None) or cache_root / "jit",
        allow_cuda_mismatch=_bool("FREETOKEN_ALLOW_CUDA_MISMATCH",
                                  e.get("FREETOKEN_ALLOW_CUDA_MISMATCH"), False),
        cache_targets=_list(e.get("FREETOKEN_CACHE_TARGETS")),
        build_jobs=_int("FREETOKEN_BUILD_JOBS", e.get("FREETOKEN_BUILD_JOBS"), 0),
        build_dir=_path(e.get("FREETOKEN_BUILD_DIR"), None),
        num_threads=_int("FREETOKEN_NUM_THREADS", e.get("FREETOKEN_NUM_THREADS"), 0),
        home=_path(e.get("FREETOKEN_HOME"), None) or Path.home() / ".freetoken",
        hip_clang=(e.get("FREETOKEN_HIP_CLANG") or "").strip() or None,
        log_level=level,
        release_url=(e.get("FREETOKEN_RELEASE_URL") or RELEASE_URL).strip().rstrip("/"),
        fused_decode=_bool("FREETOKEN_FUSED_DECODE", e.get("FREETOKEN_FUSED_DECODE"), True),
        moe_decode=_bool("FREETOKEN_MOE_DECODE", e.get("FREETOKEN_MOE_DECODE"), True),
        quant_gemv=quant_gemv,
        tp_timeout_s=_int("FREETOKEN_TP_TIMEOUT", e.get("FREETOKEN_TP_TIMEOUT"), 60, minimum=1),
        cpu_pack=_bool("FREETOKEN_CPU_PACK", e.get("FREETOKEN_CPU_PACK"), True),
        driver_copies=_bool("FREETOKEN_DRIVER_COPIES", e.get("FREETOKEN_DRIVER_COPIES"), False),
        fault_marker=e.get("FREETOKEN_FAULT_MARKER") or None,
    )

