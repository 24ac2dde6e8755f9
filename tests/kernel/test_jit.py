"""JIT fallback: builds, reuses its result, refuses when disabled, and survives races."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from freetoken.kernel import ops, reference
from freetoken.kernel.errors import KernelUnavailable
from tests.conftest import compiler_free_env
from tests.tolerances import assert_close

CHECK = """
import sys, time, torch
from freetoken.kernel import ops, reference
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))
x = torch.randn(5, 2 * 37)
out, ref = torch.empty(5, 37), torch.empty(5, 37)
ops.silu_and_mul(out, x)
reference.silu_and_mul(ref, x)
# float32 rounding of silu(g) * u: a few ulps of the largest value
limit = 8 * torch.finfo(torch.float32).eps * ref.abs().max()
assert ((out - ref).abs() <= limit).all(), (out - ref).abs().max()
print("OK")
"""


def _silu_matches() -> None:
    x = torch.randn(3, 2 * 100)
    out, ref = torch.empty(3, 100), torch.empty(3, 100)
    ops.silu_and_mul(out, x)
    reference.silu_and_mul(ref, x)
    assert_close(out, ref, torch.float32)


def test_jit_builds_then_reuses_without_a_compiler(jit_only):
    _silu_matches()
    built = list((jit_only / "cpu-x86_64").glob("activation-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    env = compiler_free_env({"FREETOKEN_DISABLE_KERNEL_CACHE": "1", "FREETOKEN_DISABLE_JIT": "1",
                             "FREETOKEN_JIT_DIR": str(jit_only)})
    done = subprocess.run([sys.executable, "-c", CHECK, "0"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_disabled_jit_names_the_kernel(jit_only, monkeypatch):
    monkeypatch.setenv("FREETOKEN_DISABLE_JIT", "1")
    with pytest.raises(KernelUnavailable) as info:
        ops.silu_and_mul(torch.empty(1, 4), torch.randn(1, 8))
    message = str(info.value)
    for needle in ("'activation'", "cpu-x86_64", "FREETOKEN_DISABLE_JIT", "freetoken 0.",
                   "freetoken-kernel-cache"):
        assert needle in message
    assert not (jit_only / "cpu-x86_64").exists()


def test_no_compiler_gives_the_toolchain_fix(jit_only):
    env = compiler_free_env({"FREETOKEN_DISABLE_KERNEL_CACHE": "1", "FREETOKEN_DISABLE_JIT": "0",
                             "FREETOKEN_JIT_DIR": str(jit_only)})
    done = subprocess.run([sys.executable, "-c", CHECK, "0"], env=env, capture_output=True,
                          text=True)
    assert done.returncode != 0
    assert "KernelUnavailable" in done.stderr and "no host C++ compiler" in done.stderr


def test_four_processes_compile_the_same_kernel(jit_only):
    env = {"FREETOKEN_DISABLE_KERNEL_CACHE": "1", "FREETOKEN_DISABLE_JIT": "0",
           "FREETOKEN_JIT_DIR": str(jit_only)}
    import os

    start = time.time() + 3.0  # every process begins its build at the same moment
    procs = [subprocess.Popen([sys.executable, "-c", CHECK, str(start)],
                              env={**os.environ, **env}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0 and "OK" in out, err
    assert len(list((jit_only / "cpu-x86_64").glob("activation-*.so"))) == 1
    assert list((jit_only / ".stage").iterdir()) == []  # every private stage was removed
