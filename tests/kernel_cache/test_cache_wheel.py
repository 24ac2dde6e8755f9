"""The cache wheel: complete index, pairing, and loading with no compiler and JIT disabled."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zipfile

import pytest
import torch

from freetoken import __version__
from freetoken.csrc import build
from freetoken.kernel import cache as kcache, loader, ops
from freetoken.kernel.errors import KernelUnavailable
from tests.conftest import REPO, compiler_free_env


def test_index_covers_the_registry(cache_wheel, cache_dir):
    index = json.loads((cache_dir / "index.json").read_text())
    public, _, local = index["freetoken_version"].partition("+")
    assert public == __version__.partition("+")[0] and local
    assert cache_wheel.name.startswith(f"freetoken_kernel_cache-{index['freetoken_version']}-py3-none-manylinux_2_")
    for kernel in build.registry.KERNELS:
        for target in kernel.targets():
            if target not in index["targets"]:
                continue
            backend = build.registry.backend_of(target)
            cuda_major = int(index["cuda"].split(".")[0]) if backend == "cuda" else None
            key = build.kernel_key(kernel, kernel.variants[0], backend, cuda_major)
            entry = index["kernels"][key]["targets"][target]
            assert kcache.sha256_file(cache_dir / entry["file"]) == entry["sha256"]
    with zipfile.ZipFile(cache_wheel) as zf:
        names = zf.namelist()
    # Only built objects and their index: no kernel sources travel in the cache wheel.
    assert not [n for n in names if n.startswith("freetoken_kernel_cache/cache/")
                and not n.endswith((".so", "/index.json"))]
    assert not [n for n in names if n.endswith((".cc", ".cu", ".h", ".cuh"))]


def test_fresh_venv_loads_every_cpu_kernel_without_compiling(fresh_venv):
    env = compiler_free_env({"FREETOKEN_DISABLE_JIT": "1", "FREETOKEN_JIT_DIR": "/nonexistent"})
    env["PATH"] = str(fresh_venv / "bin")
    verify = subprocess.run([str(fresh_venv / "bin" / "ft"), "kernels", "verify"], env=env,
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "would compile" not in verify.stdout and " cache " in verify.stdout
    tests = subprocess.run([str(fresh_venv / "bin" / "python"), "-m", "pytest", "-q", "-p",
                            "no:cacheprovider", "tests/kernel/test_cpu_kernels.py",
                            "tests/kernel/test_moe_cpu.py"],
                           cwd=REPO, env=env, capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout


@pytest.fixture
def cache_copy(cache_dir, tmp_path, monkeypatch):
    copy = tmp_path / "cache"
    shutil.copytree(cache_dir, copy)
    monkeypatch.setenv("FREETOKEN_KERNEL_CACHE_DIR", str(copy))
    monkeypatch.setenv("FREETOKEN_DISABLE_JIT", "1")
    monkeypatch.setenv("FREETOKEN_JIT_DIR", str(tmp_path / "no-jit"))
    loader.clear_loaded()
    yield copy
    loader.clear_loaded()


def _silu() -> None:
    ops.silu_and_mul(torch.empty(2, 8), torch.randn(2, 16))


def test_cache_copy_loads(cache_copy):
    _silu()
    res = loader.resolve("activation", loader.device_spec("cpu"))
    assert res.source == "cache" and res.path.is_relative_to(cache_copy)


def test_corrupted_kernel_is_refused(cache_copy):
    (so,) = (cache_copy / "cpu-x86_64").glob("activation-*.so")
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))
    with pytest.raises(KernelUnavailable, match="sha256"):
        _silu()


def test_version_mismatched_cache_is_refused(cache_copy):
    index = json.loads((cache_copy / "index.json").read_text())
    index["freetoken_version"] = "0.0.9+cpu"
    (cache_copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(KernelUnavailable, match="0.0.9"):
        _silu()


def test_ft_kernels_lists_what_each_target_covers(cache_copy):
    from click.testing import CliRunner

    from freetoken.cli.kernels import kernels_command

    index = json.loads((cache_copy / "index.json").read_text())
    expected = {t: sorted(k.name for k in build.registry.KERNELS if t in k.targets())
                for t in index["targets"]}
    listed = CliRunner().invoke(kernels_command, ["--json"])
    assert listed.exit_code == 0, listed.output
    cache = json.loads(listed.output)["cache"]
    assert cache["targets"] == expected and cache["version"] == index["freetoken_version"]
    human = CliRunner().invoke(kernels_command, [])
    assert human.exit_code == 0, human.output
    for target, names in expected.items():
        line = rf"\n  {re.escape(target)} +{len(names)} kernels: {re.escape(', '.join(names))}\n"
        assert re.search(line, human.output), human.output


def test_rocm_targets_cover_the_cuda_kernel_set(cache_dir):
    coverage = kcache.load_index(cache_dir).coverage()
    rocm = [t for t in coverage if build.registry.backend_of(t) == "rocm"]
    if not rocm:
        pytest.skip("this cache wheel holds no ROCm targets (no HIP clang where it was built)")
    gpu_kernels = sorted(k.name for k in build.registry.KERNELS if k.cuda)
    for target, names in coverage.items():
        if build.registry.backend_of(target) != "cpu":
            assert names == gpu_kernels, f"{target} covers {names}"
