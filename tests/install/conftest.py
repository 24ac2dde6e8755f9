"""Session fixtures: a clean committed copy of the repo, the nightly pair built from it once,
and a loopback HTTP server that serves release folders."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import REPO


def script_env(**extra: str) -> dict:
    """os.environ without FREETOKEN_* settings, this interpreter first on PATH (uv, python3)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FREETOKEN_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env


def run_script(script: str, *args: str, env: dict | None = None, **kwargs):
    """Run a ci/ shell script of `kwargs.get('repo', REPO)`; returns the CompletedProcess."""
    repo = kwargs.pop("repo", REPO)
    return subprocess.run(["bash", str(Path(repo) / "ci" / script), *args], env=env or script_env(),
                          capture_output=True, text=True, **kwargs)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout


def _commit_all(repo: Path) -> None:
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=FreeToken tests", "-c", "user.email=tests@freetoken.invalid",
        "-c", "commit.gpgsign=false", "commit", "-q", "-m", "snapshot of the working tree")


def committed_copy(dest: Path) -> Path:
    """A clean clone of this checkout; when it has uncommitted work (or no commit), a new repo
    holding the working tree (tracked and untracked files, not ignored ones) in one commit."""
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout of the repository (ci/nightly.sh stamps the commit)")
    has_head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "-q", "HEAD"],
                              capture_output=True).returncode == 0
    if has_head and not git(REPO, "status", "--porcelain"):
        subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True)
        return dest
    listing = git(REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for rel in filter(None, listing.split("\0")):
        source = REPO / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    git(dest, "init", "-q")
    _commit_all(dest)
    return dest


@pytest.fixture(scope="session")
def source_repo(tmp_path_factory) -> Path:
    return committed_copy(tmp_path_factory.mktemp("source") / "freetoken")


@dataclass(frozen=True)
class NightlyPair:
    out: Path
    manifest_path: Path
    manifest: dict
    commit: str
    runtime: Path
    cache: Path


@pytest.fixture(scope="session")
def nightly_pair(source_repo, release_server, tmp_path_factory) -> NightlyPair:
    """ci/nightly.sh run once on the clean copy, CPU targets only (fast on two cores), with the
    loopback server as the release location: the manifest's URLs point under it."""
    out = tmp_path_factory.mktemp("release") / "nightly"
    tmp = tmp_path_factory.mktemp("nightly-tmp")
    result = run_script("nightly.sh", str(out), repo=source_repo,
                        env=script_env(FREETOKEN_CACHE_TARGETS="cpu", TMPDIR=str(tmp),
                                       FREETOKEN_RELEASE_URL=release_server.url))
    if result.returncode != 0:
        pytest.fail(f"ci/nightly.sh failed ({result.returncode}):\n{result.stderr[-4000:]}")
    manifest_path = out / "engine-linux_x86_64.json"
    manifest = json.loads(manifest_path.read_text())
    return NightlyPair(out, manifest_path, manifest, git(source_repo, "rev-parse", "HEAD")[:9],
                       out / manifest["runtime"]["name"], out / manifest["kernel_cache"]["name"])


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@dataclass(frozen=True)
class ReleaseServer:
    root: Path
    url: str

    def publish(self, folder: Path, name: str) -> str:
        """Copy a release folder under the server root; returns its base URL."""
        shutil.copytree(folder, self.root / name)
        return f"{self.url}/{name}/"


@pytest.fixture(scope="session")
def release_server(tmp_path_factory):
    """python's http.server on 127.0.0.1 (a free port) in a thread, serving a temp folder."""
    root = tmp_path_factory.mktemp("www")
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield ReleaseServer(root, f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()
    server.server_close()


@dataclass(frozen=True)
class InstalledPair:
    home: Path          # a FREETOKEN_HOME: the venv is home/venv, as ci/install.sh lays it out
    venv: Path
    manifest_url: str
    torch_version: str  # installed before the pair; the pair must keep it


def venv_versions(venv: Path, *names: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys; "
            "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code, *names], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


@pytest.fixture(scope="session")
def installed_pair(nightly_pair, release_server, tmp_path_factory) -> InstalledPair:
    """A fresh venv with CPU torch (from the local wheel cache), then the nightly pair installed
    by ci/fetch-nightly-pair.sh from the loopback server."""
    home = tmp_path_factory.mktemp("ft-home")
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    torch = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                            "--disable-pip-version-check", "torch==2.13.0"],
                           capture_output=True, text=True)
    if torch.returncode != 0:
        pytest.fail(f"could not install torch==2.13.0 into the fresh venv:\n{torch.stderr[-2000:]}")
    torch_version = venv_versions(venv, "torch")["torch"]
    # Published where the manifest says: <release location>/nightly-<sha9>/.
    url = (release_server.publish(nightly_pair.out, f"nightly-{nightly_pair.commit}")
           + "engine-linux_x86_64.json")
    result = run_script("fetch-nightly-pair.sh", "--manifest", url, "--venv", str(venv))
    if result.returncode != 0:
        pytest.fail(f"ci/fetch-nightly-pair.sh failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return InstalledPair(home, venv, url, torch_version)
