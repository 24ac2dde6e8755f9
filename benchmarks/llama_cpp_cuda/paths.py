"""Where the staged sources, the build and its tools live.

- the staged folder (`stage DEST`): the llama.cpp sources of one llama-cpp-python sdist as a
  tarball, small enough to travel with the repository to a GPU machine without network.
  Default: <repo>/.carry/llama-cpp (.carry/ is git-ignored), or $FREETOKEN_LLAMA_CPP_STAGE.
- the home folder ($LCPP_HOME, default ~/llama.cpp-peer: /root/llama.cpp-peer on the GPU
  machines): the unpacked sources (src/, all the converter needs), the build (build/bin/) and
  build.json, the build's state.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.3.36"                    # llama-cpp-python sdist: llama.cpp of 2026-10-01
SOURCES = "llama.cpp-src.tar.gz"      # the tarball inside the staged folder
MANIFEST = "staged.json"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server", "llama-lookup",
         "llama-speculative-simple")


class PeerUnavailable(RuntimeError):
    """A staged folder, the sources or a built tool is missing; the message says what to run."""


def staged_dir(peer: Path | None = None) -> Path:
    if peer is not None:
        return Path(peer)
    return Path(os.environ.get("FREETOKEN_LLAMA_CPP_STAGE") or REPO / ".carry" / "llama-cpp")


def home() -> Path:
    return Path(os.environ.get("LCPP_HOME") or Path.home() / "llama.cpp-peer")


def bin_dir() -> Path:
    return home() / "build" / "bin"


def state_path() -> Path:
    return home() / "build.json"


def read_state() -> dict:
    """build.json: {"status": "building" | "built" | "failed", ...}; {} before any build."""
    try:
        return json.loads(state_path().read_text())
    except (OSError, ValueError):
        return {}


def tool(name: str) -> Path:
    """The built tool's path; PeerUnavailable says why it is not there."""
    path = bin_dir() / name
    if os.access(path, os.X_OK):
        return path
    state = read_state()
    if state.get("status") == "building":
        why = f"the llama.cpp build in {home()} is still running (started {state.get('started')})"
    elif state.get("status") == "failed":
        why = f"the llama.cpp build in {home()} failed: {state.get('error')}"
    else:
        why = (f"no llama.cpp build in {home()} (run `python -m benchmarks.llama_cpp_cuda build`, "
               f"or set LCPP_HOME)")
    raise PeerUnavailable(f"{name}: {why}")


def sources(peer: Path | None = None) -> Path:
    """The unpacked llama.cpp sources (home()/src), unpacked from the staged tarball on first
    use. Two processes may race here (a build and a conversion): each unpacks into its own
    temporary folder and the first rename wins."""
    src = home() / "src"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    tarball = staged_dir(peer) / SOURCES
    if not tarball.is_file():
        raise PeerUnavailable(
            f"no staged llama.cpp sources at {tarball}: run `python -m benchmarks.llama_cpp_cuda "
            f"stage` where PyPI is reachable and carry {staged_dir(peer)} (or pass --peer DIR)")
    home().mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="src-", dir=home()))
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(scratch, filter="data")
        try:
            scratch.rename(src)
        except OSError:          # another process got there first
            if not (src / "convert_hf_to_gguf.py").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return src


def import_gguf():
    """The `gguf` package: the installed one, else the copy beside llama.cpp's converter in the
    staged sources (the GPU image has none; same API)."""
    try:
        import gguf
    except ImportError:
        sys.path.append(str(sources() / "gguf-py"))
        import gguf
    return gguf
