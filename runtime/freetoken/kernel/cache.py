"""The installed kernel cache: where it is, its index, and whether it pairs with this runtime."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from freetoken import __version__
from freetoken.env import Env
from freetoken.kernel.errors import KernelCacheError

INDEX_FORMAT = 1


@dataclass(frozen=True)
class CacheIndex:
    """A parsed index.json: kernels[key] = {kernel, variant, functions, targets{t: {file, sha256}}}."""

    root: Path
    version: str
    data: dict

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.data.get("targets", ()))

    def entry(self, key: str, target: str) -> dict | None:
        return self.data.get("kernels", {}).get(key, {}).get("targets", {}).get(target)

    def targets_for(self, key: str) -> tuple[str, ...]:
        return tuple(self.data.get("kernels", {}).get(key, {}).get("targets", {}))

    def coverage(self) -> dict[str, list[str]]:
        """target -> the kernels it holds (sorted), for every target the index lists."""
        out: dict[str, set[str]] = {t: set() for t in self.targets}
        for entry in self.data.get("kernels", {}).values():
            for target in entry.get("targets", {}):
                out.setdefault(target, set()).add(str(entry.get("kernel")))
        return {t: sorted(names) for t, names in out.items()}


def locate_cache(env: Env) -> Path | None:
    """FREETOKEN_KERNEL_CACHE_DIR, else the installed freetoken_kernel_cache wheel, else None."""
    if env.disable_kernel_cache:
        return None
    if env.kernel_cache_dir is not None:
        return env.kernel_cache_dir
    try:
        import freetoken_kernel_cache
    except ImportError:
        return None
    return Path(freetoken_kernel_cache.get_cache_dir())


def load_index(root: Path) -> CacheIndex:
    path = root / "index.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KernelCacheError(f"kernel cache {root} has no index.json; reinstall "
                               "freetoken-kernel-cache or unset FREETOKEN_KERNEL_CACHE_DIR") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise KernelCacheError(f"kernel cache index {path} is unreadable: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT:
        raise KernelCacheError(f"kernel cache index {path} has format "
                               f"{data.get('format') if isinstance(data, dict) else '?'}; "
                               f"this runtime reads format {INDEX_FORMAT}")
    return CacheIndex(root, str(data.get("freetoken_version", "")), data)


def split_version(version: str) -> tuple[str, str | None, int | None]:
    """'0.1.0+cu130.gabc' -> ('0.1.0', 'abc', 13): public part, g-stamp, CUDA major tag."""
    public, _, local = version.partition("+")
    stamp = cuda = None
    for part in filter(None, re.split(r"[.]", local)):
        if re.fullmatch(r"g[0-9a-f]{7,40}", part):
            stamp = part[1:]
        elif m := re.fullmatch(r"cu(\d+?)(\d)", part):
            cuda = int(m.group(1))
    return public, stamp, cuda


def pairing_problem(cache_version: str, runtime_version: str = __version__,
                    torch_cuda: str | None = None) -> str | None:
    """Why a cache of `cache_version` must not serve this runtime, or None when it may."""
    c_public, c_stamp, c_cuda = split_version(cache_version)
    r_public, r_stamp, _ = split_version(runtime_version)
    fix = "install the freetoken-kernel-cache wheel of the same build as the runtime"
    if c_public != r_public:
        return (f"kernel cache {cache_version} is for freetoken {c_public}, "
                f"the runtime is {runtime_version}; {fix}")
    if c_stamp != r_stamp:
        return (f"kernel cache {cache_version} (build {c_stamp or 'unstamped'}) does not pair "
                f"with runtime {runtime_version} (build {r_stamp or 'unstamped'}); {fix}")
    if c_cuda is not None and torch_cuda and int(torch_cuda.split(".")[0]) != c_cuda:
        return (f"kernel cache {cache_version} holds CUDA {c_cuda} kernels but torch uses CUDA "
                f"{torch_cuda}; install the cache built for CUDA {torch_cuda.split('.')[0]}")
    return None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
