"""Test helpers: small installable wheels, re-stamped copies of real ones, CI-script loading."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO

CI = REPO / "ci"


def load_ci(name: str):
    """Import ci/<name>.py (the CI helpers are scripts, not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def write_wheel(path: Path, dist: str, version: str, files: dict[str, bytes],
                tag: str = "py3-none-any") -> Path:
    """A valid wheel (METADATA, WHEEL, RECORD) holding `files`."""
    dist_info = f"{dist}-{version}.dist-info"
    meta = {
        f"{dist_info}/METADATA": (f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\n"
                                  f"Version: {version}\n").encode(),
        f"{dist_info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                               f"Tag: {tag}\n").encode(),
    }
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for arcname, data in {**files, **meta}.items():
            zf.writestr(arcname, data)
            records.append(_record_line(arcname, data))
        records.append(f"{dist_info}/RECORD,,")
        zf.writestr(f"{dist_info}/RECORD", "\n".join(records) + "\n")
    return path


def fake_pair(folder: Path, commit: str, cuda: str | None = None,
              cache_commit: str | None = None) -> tuple[Path, Path]:
    """A tiny runtime wheel and kernel-cache wheel shaped like the real ones."""
    folder.mkdir(parents=True, exist_ok=True)
    runtime_version = f"0.1.0+g{commit}"
    local = (["cu" + cuda.replace(".", "")] if cuda else []) + [f"g{cache_commit or commit}"]
    cache_version = f"0.1.0+{'.'.join(local)}"
    runtime = write_wheel(
        folder / f"freetoken-{runtime_version}-py3-none-any.whl", "freetoken", runtime_version,
        {"freetoken/__init__.py": f'__version__ = "{runtime_version}"\n'.encode()})
    index = {"format": 1, "freetoken_version": cache_version,
             "cuda": f"{cuda}.88" if cuda else None, "targets": [], "kernels": {}}
    tag = "py3-none-manylinux_2_28_x86_64"
    cache = write_wheel(
        folder / f"freetoken_kernel_cache-{cache_version}-{tag}.whl", "freetoken_kernel_cache",
        cache_version, {"freetoken_kernel_cache/__init__.py": b"",
                        "freetoken_kernel_cache/cache/index.json": json.dumps(index).encode()},
        tag=tag)
    return runtime, cache


def restamp(wheel: Path, folder: Path, version: str) -> Path:
    """A copy of `wheel` claiming another version: dist-info, METADATA and file name rewritten."""
    dist, old, tag = wheel.name[: -len(".whl")].split("-", 2)
    old_info, new_info = f"{dist}-{old}.dist-info/", f"{dist}-{version}.dist-info/"
    out = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.startswith(old_info):
                data = data.replace(old.encode(), version.encode())
            dst.writestr(item.filename.replace(old_info, new_info), data)
    return out


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Change one byte in place (the size stays the same)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0x01
    path.write_bytes(bytes(data))


def manifest_for(runtime: Path, cache: Path, commit: str, cuda: str | None = None,
                 base_url: str = "") -> dict:
    """A schema-1 manifest with true sizes and hashes, written without write_manifest's checks."""
    wheel_pair = load_ci("wheel_pair")

    def entry(path: Path) -> dict:
        return {"name": path.name, "url": base_url + path.name,
                "sha256": wheel_pair.sha256_file(path), "size": path.stat().st_size}

    return {"schema": 1, "channel": "nightly", "platform": "linux_x86_64",
            "version": runtime.name.split("-")[1], "commit": commit,
            "published": "2026-01-01T00:00:00Z", "python": ">=3.10", "cuda": cuda,
            "runtime": entry(runtime), "kernel_cache": entry(cache)}
