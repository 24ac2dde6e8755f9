"""Start-up's kernel report: counts by source, one progress line per compile, and one error
naming the fix when nothing may load."""

import pytest

from freetoken.csrc.build import registry
from freetoken.kernel import preload
from freetoken.kernel.errors import KernelUnavailable

CPU_KERNELS = [k.name for k in registry.KERNELS if "cpu-x86_64" in k.targets()]


def test_no_cache_and_jit_allowed_counts_every_kernel_as_a_compile(jit_only, monkeypatch):
    plan = preload.plan_kernels("cpu")
    assert [r.kernel for r in plan.resolutions] == CPU_KERNELS
    assert plan.summary() == (f"{len(CPU_KERNELS)} kernels: 0 from the kernel cache, "
                              f"{len(CPU_KERNELS)} to compile")
    loaded, said = [], []
    monkeypatch.setattr(preload, "get_module", lambda name, device: loaded.append(name))
    preload.load_kernels("cpu", plan, said.append)
    compiling = [line for line in said if line.startswith("compiling kernel")]
    assert compiling[0].startswith(f"compiling kernel 1/{len(CPU_KERNELS)}: {CPU_KERNELS[0]} "
                                   "for cpu-x86_64")
    assert len(compiling) == len(CPU_KERNELS) and str(jit_only) in compiling[0]
    assert sorted(set(loaded)) == sorted(CPU_KERNELS)


def test_nothing_loadable_is_one_error_naming_both_variables(jit_only, monkeypatch):
    monkeypatch.setenv("FREETOKEN_DISABLE_JIT", "1")
    plan = preload.plan_kernels("cpu")
    assert plan.summary().endswith(f"{len(CPU_KERNELS)} unavailable")
    with pytest.raises(KernelUnavailable) as info:
        preload.load_kernels("cpu", plan, lambda line: None)
    message = str(info.value)
    assert "\n" not in message and CPU_KERNELS[0] in message
    assert "FREETOKEN_DISABLE_KERNEL_CACHE" in message and "FREETOKEN_DISABLE_JIT" in message
