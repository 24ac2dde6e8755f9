"""`ft doctor`: what this machine has (GPU, torch, compilers, kernel cache) and how to fix gaps."""

from __future__ import annotations

import shutil
import subprocess
import sys

import click


def _driver_line() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return f"driver: {out.stdout.strip().splitlines()[0]}"


def _gpu_lines(torch) -> list[str]:
    if torch is None:
        return ["GPU: not checked (torch is not installed; CPU serving needs none)"]
    if not torch.cuda.is_available():
        return ["GPU: none visible to torch (CPU serving only)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        arch = p.gcnArchName if getattr(torch.version, "hip", None) else f"sm_{p.major}{p.minor}"
        lines.append(f"GPU {i}: {p.name} ({arch}, {p.total_memory / 2**30:.0f} GiB)")
    driver = _driver_line()
    return lines + ([driver] if driver else [])


def _import_torch():
    """torch, or None when it is not installed (or does not import)."""
    from freetoken.arrays import torch_installed

    if not torch_installed():
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def _torch_facts(torch) -> tuple[list[str], list[str]]:
    """(facts, problems) about torch: what GPU serving needs and whether it is here."""
    from freetoken.arrays import CUDA_INSTALL_HINT, gpu_device_files

    if torch is not None:
        return [f"torch {torch.__version__} (CUDA {torch.version.cuda or '-'}, "
                f"HIP {getattr(torch.version, 'hip', None) or '-'})"], []
    facts = ["torch: not installed (CPU serving needs none; GPU serving needs it)"]
    if gpu_device_files():
        return facts, [f"a GPU is present but torch is not installed, so FreeToken serves on "
                       f"the CPU. Fix: {CUDA_INSTALL_HINT}"]
    return facts, []


def _cache_facts(env, root, torch_cuda: str | None) -> tuple[list[str], list[str]]:
    """(facts, problems) about the kernel cache at `root` (None: disabled or not installed)."""
    from freetoken import __version__
    from freetoken.kernel import cache as kcache

    if env.disable_kernel_cache:
        return ["kernel cache: disabled (FREETOKEN_DISABLE_KERNEL_CACHE)"], []
    if root is None:
        return [], ["no kernel cache: every kernel must be compiled on first use (or fails "
                    "with FREETOKEN_DISABLE_JIT=1). Fix: install the freetoken-kernel-cache "
                    "wheel paired with this runtime (ci/install.sh or ci/fetch-nightly-pair.sh)"]
    try:
        index = kcache.load_index(root)
    except kcache.KernelCacheError as exc:
        return [], [str(exc)]
    pairing = kcache.pairing_problem(index.version, __version__, torch_cuda)
    facts = [f"kernel cache: {index.version} at {root}",
             f"cache targets: {', '.join(index.targets)}",
             f"pairing with runtime: {'ok' if not pairing else 'REFUSED'}"]
    return facts, [pairing] if pairing else []


def collect() -> tuple[list[str], list[str]]:
    """(facts, problems-with-fixes) for this machine."""
    from freetoken import __version__, env as ft_env
    from freetoken.kernel import cache as kcache
    from freetoken.toolchain import checks

    torch = _import_torch()
    torch_cuda = torch.version.cuda if torch is not None else None
    torch_hip = getattr(torch.version, "hip", None) if torch is not None else None
    facts = [f"freetoken {__version__}"] + _gpu_lines(torch)
    more_facts, problems = _torch_facts(torch)
    facts += more_facts
    env = ft_env.read()
    cxx, nvcc = checks.find_cxx(), checks.find_nvcc()
    try:
        clang = checks.find_hip_clang(env.hip_clang)
    except checks.ToolchainError as exc:
        clang = None
        problems.append(str(exc))
    facts.append(f"C++ compiler: {f'{cxx.path} {cxx.version}' if cxx else 'none'}")
    facts.append(f"nvcc: {f'{nvcc[0].path} {nvcc[0].version} (CUDA_HOME {nvcc[1]})' if nvcc else 'none'}")
    facts.append(f"HIP clang: {f'{clang.path} {clang.version}' if clang else 'none'}")
    facts.append(f"JIT: {'disabled (FREETOKEN_DISABLE_JIT)' if env.disable_jit else 'allowed'}; "
                 f"JIT folder {env.jit_dir}")
    if torch is not None:
        for problem in (checks.check_cuda_match(nvcc[0] if nvcc else None, torch_cuda,
                                                env.allow_cuda_mismatch),
                        checks.check_hip_match(clang, torch_hip)):
            if problem:
                problems.append(str(problem))
    root = kcache.locate_cache(env)
    cache_facts, cache_problems = _cache_facts(env, root, torch_cuda)
    facts += cache_facts
    problems += cache_problems
    if cxx is None and env.disable_jit is False and root is None:
        problems.append(str(checks.check_host_compiler(None)))
    return facts, problems


@click.command("doctor")
def doctor_command() -> None:
    """Report GPU, driver, torch, compilers and the kernel cache, with a fix for each problem."""
    facts, problems = collect()
    for line in facts:
        click.echo(line)
    if problems:
        click.echo(f"\n{len(problems)} problem(s):")
        for p in problems:
            click.echo(f"- {p}")
        sys.exit(1)
    click.echo("\nno problems found")
