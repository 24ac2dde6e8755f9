"""Arch selection by CUDA compatibility rules, on a table of device capabilities."""

import pytest

from freetoken.kernel.targets import DeviceSpec, jit_target, rank_targets

CACHE = ("sm_86", "sm_89", "sm_90a", "sm_100f", "sm_120", "compute_120")


@pytest.mark.parametrize("capability, best", [
    ((8, 6), "sm_86"),
    ((8, 7), "sm_86"),      # same major, newer minor runs sm_86 SASS
    ((8, 9), "sm_89"),
    ((9, 0), "sm_90a"),     # arch-specific: exact match only
    ((10, 0), "sm_100f"),
    ((10, 3), "sm_100f"),   # family target covers 10.x
    ((12, 0), "sm_120"),
    ((12, 1), "sm_120"),
    ((7, 5), None),         # older than every image and than the PTX
    ((11, 0), None),        # no 11.x SASS, and PTX 12.0 cannot run on 11.0
    ((13, 0), "compute_120"),  # newer arch: the driver JIT-compiles the PTX
])
def test_best_cuda_target(capability, best):
    ranked = rank_targets(CACHE, DeviceSpec("cuda", capability=capability))
    assert (ranked[0] if ranked else None) == best


def test_sm90a_never_runs_elsewhere_and_ptx_ranks_last():
    assert "sm_90a" not in rank_targets(CACHE, DeviceSpec("cuda", capability=(9, 1)))
    ranked = rank_targets(CACHE, DeviceSpec("cuda", capability=(12, 1)))
    assert ranked == ["sm_120", "compute_120"]


def test_cpu_and_rocm_need_exact_targets():
    assert rank_targets(("cpu-x86_64", "sm_86"), DeviceSpec("cpu")) == ["cpu-x86_64"]
    targets = ("gfx1151", "gfx1201")
    assert rank_targets(targets, DeviceSpec("rocm", gfx="gfx1201")) == ["gfx1201"]
    assert rank_targets(targets, DeviceSpec("rocm", gfx="gfx1100")) == []


def test_jit_target_is_the_exact_device():
    assert jit_target(DeviceSpec("cuda", capability=(9, 0))) == "sm_90a"
    assert jit_target(DeviceSpec("cuda", capability=(8, 7))) == "sm_87"
    assert jit_target(DeviceSpec("cpu")) == "cpu-x86_64"
