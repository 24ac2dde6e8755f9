"""Runtime/cache pairing: exact public version, equal build stamps, CUDA major."""

import json

import pytest

from freetoken.kernel import cache as kcache
from freetoken.kernel.errors import KernelCacheError


@pytest.mark.parametrize("cache, runtime, torch_cuda, ok", [
    ("0.1.0+cpu", "0.1.0", None, True),
    ("0.1.0+cu130", "0.1.0", "13.0", True),
    ("0.1.0+cu130.gabcdef123", "0.1.0+gabcdef123", "13.0", True),
    ("0.1.0+cu130.gabcdef123", "0.1.0+gabcdef124", "13.0", False),   # other build
    ("0.1.0+cu130.gabcdef123", "0.1.0", "13.0", False),              # stamped vs unstamped
    ("0.1.0+cu130", "0.1.0", "12.8", False),                         # CUDA major differs
    ("0.1.0+cu130", "0.1.0", None, True),                            # CPU torch: CPU kernels only
    ("0.1.1+cpu", "0.1.10", None, False),                            # no prefix matching
    ("0.1.10+cpu", "0.1.1", None, False),
])
def test_pairing(cache, runtime, torch_cuda, ok):
    problem = kcache.pairing_problem(cache, runtime, torch_cuda)
    assert (problem is None) == ok, problem
    if problem:
        assert cache in problem


def test_split_version():
    assert kcache.split_version("0.1.0+cu130.g0123456789") == ("0.1.0", "0123456789", 13)
    assert kcache.split_version("0.1.0+cu129") == ("0.1.0", None, 12)
    assert kcache.split_version("0.1.0") == ("0.1.0", None, None)


def test_index_errors_name_the_file(tmp_path):
    with pytest.raises(KernelCacheError, match="no index.json"):
        kcache.load_index(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(KernelCacheError, match="unreadable"):
        kcache.load_index(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(KernelCacheError, match="format 99"):
        kcache.load_index(tmp_path)
