"""`stage DEST`: llama.cpp's sources from the llama-cpp-python sdist, packed for a machine
without network (run where PyPI is reachable).

Only what building the CUDA tools and running the HF -> GGUF converter needs goes in: the CMake
tree (cmake/, ggml/, src/, include/, common/, vendor/, tools/, examples/, pocs/ and the one
script of scripts/ that CMake runs), the converter (convert_hf_to_gguf.py, conversion/, gguf-py/)
and the licenses. Left out: tests, docs, models (vocabulary GGUFs), the web UI's sources (the
build embeds no UI), platform bindings and the ggml backends other than CPU and CUDA. About 6 MB
compressed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks.llama_cpp_cuda.paths import MANIFEST, SOURCES, VERSION

KEEP = ("CMakeLists.txt", "cmake", "common", "ggml", "include", "src", "vendor", "tools",
        "examples", "pocs", "scripts/ui-assets.cmake", "convert_hf_to_gguf.py", "conversion",
        "gguf-py", "LICENSE", "licenses")
# path prefixes (relative to vendor/llama.cpp) and suffixes left out of what KEEP names
DROP_PREFIXES = ("tools/ui/src", "tools/ui/tests", "tools/ui/package-lock.json",
                 "examples/llama.android", "examples/llama.swiftui", "examples/sycl",
                 "gguf-py/tests",
                 # backends CMake only enters when enabled (ggml_add_backend): CUDA and CPU stay
                 *(f"ggml/src/ggml-{b}" for b in ("sycl", "cann", "musa", "opencl", "vulkan",
                                                  "metal", "hexagon", "webgpu", "et", "openvino",
                                                  "virtgpu", "zdnn", "zendnn", "hip")))
DROP_SUFFIXES = (".gguf", ".pyc")


def download_sdist(version: str, into: Path) -> Path:
    """`pip download --no-deps --no-binary :all:` of llama-cpp-python==version."""
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                          "--no-binary", ":all:", "--disable-pip-version-check", "-d", str(into),
                          f"llama-cpp-python=={version}"], capture_output=True, text=True)
    found = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if run.returncode or not found:
        raise SystemExit(f"error: pip could not download the llama-cpp-python=={version} sdist: "
                         f"{(run.stderr.strip().splitlines() or ['no file'])[-1]}")
    return found[0]


def kept(relative: str) -> bool:
    """Whether a path under vendor/llama.cpp goes into the staged tarball."""
    if not any(relative == k or relative.startswith(k + "/") for k in KEEP):
        return False
    if any(relative == p or relative.startswith(p + "/") for p in DROP_PREFIXES):
        return False
    return not relative.endswith(DROP_SUFFIXES) and "/__pycache__" not in relative


def pack(sdist: Path, dest: Path) -> dict:
    """Write dest/llama.cpp-src.tar.gz (paths relative to the llama.cpp root) and
    dest/staged.json; returns the manifest."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = None
    files = 0
    out = dest / (SOURCES + ".part")
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz", compresslevel=9) as tar:
        for member in src:
            parts = member.name.split("/vendor/llama.cpp/", 1)
            if len(parts) != 2 or not (member.isfile() or member.isdir()):
                continue
            prefix = parts[0]
            if not kept(parts[1]) or member.isdir():
                continue
            # a fresh header: the sdist's own (pax) headers would carry the old path along
            info = tarfile.TarInfo(parts[1])
            info.size, info.mode, info.mtime = member.size, member.mode, member.mtime
            tar.addfile(info, src.extractfile(member))
            files += 1
    if prefix is None or not files:
        raise SystemExit(f"error: {sdist.name} holds no vendor/llama.cpp")
    out.rename(dest / SOURCES)
    manifest = {"sdist": sdist.name, "sdist_sha256": _sha256(sdist), "files": files,
                "bytes": (dest / SOURCES).stat().st_size,
                "staged": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def stage(dest: Path, version: str = VERSION, sdist: Path | None = None) -> dict:
    """Download the sdist (unless `sdist` names one already here) and pack it into `dest`."""
    if sdist is not None:
        return pack(sdist, dest)
    with tempfile.TemporaryDirectory() as tmp:
        return pack(download_sdist(version, Path(tmp)), dest)
