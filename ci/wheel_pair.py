"""The nightly wheel pair: wheel names, build stamps, and the checks both ends of CI apply.

Stdlib only (any python3 >= 3.8): imported by ci/write_manifest.py (the nightly side) and
ci/fetch_pair.py (the install side), which run before any venv exists.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

SCHEMA = 1
PLATFORM = "linux_x86_64"
RUNTIME_DIST = "freetoken"
CACHE_DIST = "freetoken_kernel_cache"
MANIFEST_NAME = f"engine-{PLATFORM}.json"
WHEEL_NAME = re.compile(r"[A-Za-z0-9_]+-[A-Za-z0-9_.+!]+(-[0-9][A-Za-z0-9_]*)?-[^-/]+-[^-/]+-[^-/]+\.whl")
SHA256 = re.compile(r"[0-9a-f]{64}")
COMMIT = re.compile(r"[0-9a-f]{7,40}")


class PairError(Exception):
    """A wheel, a pair or a manifest that must not be installed; the message says why and the fix."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_parts(name: str) -> tuple[str, str, str]:
    """'freetoken-0.1.0+gabc-py3-none-any.whl' -> ('freetoken', '0.1.0+gabc', 'py3-none-any')."""
    if not WHEEL_NAME.fullmatch(name):
        raise PairError(f"{name!r} is not a wheel file name (dist-version-python-abi-platform.whl)")
    parts = name[: -len(".whl")].split("-")
    return parts[0], parts[1], "-".join(parts[-3:])


def metadata_version(path: Path) -> str:
    """The Version: field of the wheel's own METADATA (a renamed file cannot hide its version)."""
    dist, version, _ = wheel_parts(path.name)
    member = f"{dist}-{version}.dist-info/METADATA"
    try:
        with zipfile.ZipFile(path) as zf:
            text = zf.read(member).decode("utf-8", "replace")
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise PairError(f"{path.name} is not a readable wheel ({exc}); it may be truncated or "
                        "renamed: download it again or rebuild it with ci/nightly.sh") from None
    match = re.search(r"^Version: *(\S+) *$", text, re.MULTILINE)
    if not match:
        raise PairError(f"{path.name}: {member} has no Version field; rebuild the wheel")
    return match.group(1)


def split_version(version: str) -> tuple[str, str | None, int | None]:
    """'0.1.0+cu130.gabc123456' -> ('0.1.0', 'abc123456', 13), as the runtime pairs them."""
    public, _, local = version.partition("+")
    stamp = cuda = None
    for part in filter(None, local.split(".")):
        if re.fullmatch(r"g[0-9a-f]{7,40}", part):
            stamp = part[1:]
        elif match := re.fullmatch(r"cu(\d+?)(\d)", part):
            cuda = int(match.group(1))
    return public, stamp, cuda


def check_pair(runtime_version: str, cache_version: str, commit: str, cuda: str | None) -> None:
    """Raise PairError unless both versions carry the stamp g<commit> and agree on CUDA."""
    r_public, r_stamp, _ = split_version(runtime_version)
    c_public, c_stamp, c_cuda = split_version(cache_version)
    fix = "use a runtime and kernel cache from the same ci/nightly.sh run"
    if r_public != c_public:
        raise PairError(f"runtime {runtime_version} and kernel cache {cache_version} are different "
                        f"releases ({r_public} vs {c_public}); {fix}")
    for what, version, stamp in (("runtime", runtime_version, r_stamp),
                                 ("kernel cache", cache_version, c_stamp)):
        if stamp != commit:
            raise PairError(f"stamps do not match: {what} {version} is build "
                            f"{stamp or 'unstamped'}, the pair is commit {commit}; {fix}")
    want_cuda = int(cuda.split(".")[0]) if cuda else None
    if c_cuda != want_cuda:
        held = f"CUDA {c_cuda}" if c_cuda else "no CUDA"
        raise PairError(f"kernel cache {cache_version} holds {held} kernels but the manifest "
                        f"says cuda {cuda}; regenerate the manifest with ci/write_manifest.py")


def check_wheel_names(runtime_name: str, cache_name: str) -> tuple[str, str]:
    """(runtime version, cache version) from the names, after checking which wheel is which."""
    r_dist, r_version, r_tag = wheel_parts(runtime_name)
    c_dist, c_version, _ = wheel_parts(cache_name)
    if r_dist != RUNTIME_DIST:
        raise PairError(f"runtime wheel {runtime_name} is not a {RUNTIME_DIST} wheel")
    if c_dist != CACHE_DIST:
        raise PairError(f"kernel-cache wheel {cache_name} is not a {CACHE_DIST} wheel")
    if r_tag != "py3-none-any":
        raise PairError(f"runtime wheel {runtime_name} must be pure Python (py3-none-any)")
    return r_version, c_version
