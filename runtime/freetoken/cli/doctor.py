"""`ft doctor`: what this machine has (GPU, torch, compilers, kernel cache) and how to fix gaps."""

from __future__ import annotations

import shutil
import subprocess
import sys

import click


def _gpu_lines() -> list[str]:
    import torch

    if torch.cuda.is_available():
        lines = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            arch = p.gcnArchName if getattr(torch.version, "hip", None) else f"sm_{p.major}{p.minor}"
            lines.append(f"GPU {i}: {p.name} ({arch}, {p.total_memory / 2**30:.0f} GiB)")
        smi = shutil.which("nvidia-smi")
        if smi:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                lines.append(f"driver: {out.stdout.strip().splitlines()[0]}")
        return lines
    return ["GPU: none visible to torch (CPU serving only)"]


def collect() -> tuple[list[str], list[str]]:
    """(facts, problems-with-fixes) for this machine."""
    import torch

    from freetoken import __version__, env as ft_env
    from freetoken.kernel import cache as kcache
    from freetoken.toolchain import checks

    facts, problems = [f"freetoken {__version__}"], []
    facts += _gpu_lines()
    facts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda or '-'}, "
                 f"HIP {getattr(torch.version, 'hip', None) or '-'})")
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
    for problem in (checks.check_cuda_match(nvcc[0] if nvcc else None, torch.version.cuda,
                                            env.allow_cuda_mismatch),
                    checks.check_hip_match(clang, getattr(torch.version, "hip", None))):
        if problem:
            problems.append(str(problem))
    root = kcache.locate_cache(env)
    if root is None:
        problems.append("no kernel cache: every kernel must be compiled on first use (or fails "
                        "with FREETOKEN_DISABLE_JIT=1). Fix: install the freetoken-kernel-cache "
                        "wheel paired with this runtime (ci/install.sh or ci/fetch-nightly-pair.sh)")
    else:
        try:
            index = kcache.load_index(root)
            facts.append(f"kernel cache: {index.version} at {root}")
            facts.append(f"cache targets: {', '.join(index.targets)}")
            pairing = kcache.pairing_problem(index.version, __version__, torch.version.cuda)
            facts.append(f"pairing with runtime: {'ok' if not pairing else 'REFUSED'}")
            if pairing:
                problems.append(pairing)
        except Exception as exc:
            problems.append(str(exc))
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
