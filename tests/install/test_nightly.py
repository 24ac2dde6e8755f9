"""ci/nightly.sh: a stamped pair and its manifest, a refused dirty tree, a killed build."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest

from tests.install.conftest import REPO, git, run_script, script_env
from tests.install.wheels import load_ci


def _source_version(repo: Path) -> str:
    text = (repo / "runtime" / "freetoken" / "__init__.py").read_text()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def test_pair_is_stamped_with_the_commit(nightly_pair, source_repo):
    m, sha = nightly_pair.manifest, nightly_pair.commit
    assert sha == git(source_repo, "rev-parse", "HEAD")[:9] and m["commit"] == sha
    runtime_version = f"{_source_version(source_repo)}+g{sha}"
    assert m["version"] == runtime_version
    assert nightly_pair.runtime.name == f"freetoken-{runtime_version}-py3-none-any.whl"
    # CPU targets only: no +cu tag, the same stamp as the runtime.
    assert nightly_pair.cache.name.startswith(
        f"freetoken_kernel_cache-{runtime_version}-py3-none-manylinux_2_")
    assert m["cuda"] is None
    with zipfile.ZipFile(nightly_pair.runtime) as zf:
        assert f'__version__ = "{runtime_version}"' in zf.read("freetoken/__init__.py").decode()
    with zipfile.ZipFile(nightly_pair.cache) as zf:
        index = json.loads(zf.read("freetoken_kernel_cache/cache/index.json"))
    assert index["freetoken_version"] == runtime_version and index["targets"] == ["cpu-x86_64"]
    # Stamping happened in an export: the checkout is untouched.
    assert git(source_repo, "status", "--porcelain") == ""
    assert "+g" not in _source_version(source_repo)


def test_manifest_records_true_hashes_and_sizes(nightly_pair, release_server):
    wheel_pair = load_ci("wheel_pair")
    for key, path in (("runtime", nightly_pair.runtime), ("kernel_cache", nightly_pair.cache)):
        entry = nightly_pair.manifest[key]
        # Absolute, under the release location (FREETOKEN_RELEASE_URL in the fixture).
        assert entry["name"] == path.name
        assert entry["url"] == f"{release_server.url}/nightly-{nightly_pair.commit}/{path.name}"
        assert entry["size"] == path.stat().st_size
        assert entry["sha256"] == wheel_pair.sha256_file(path)


def test_manifest_matches_the_schema(nightly_pair):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "ci" / "manifest.schema.json").read_text())
    jsonschema.validate(nightly_pair.manifest, schema)


def test_base_url_prefixes_the_wheel_urls(nightly_pair, tmp_path):
    write_manifest = load_ci("write_manifest")
    m = write_manifest.build_manifest(nightly_pair.runtime, nightly_pair.cache, nightly_pair.commit,
                                      "https://example.invalid/nightly/2026-01-01")
    assert m["runtime"]["url"] == ("https://example.invalid/nightly/2026-01-01/"
                                   + nightly_pair.runtime.name)


@pytest.mark.parametrize("change", ["modified", "untracked"])
def test_refuses_a_dirty_tree(source_repo, tmp_path, change):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(source_repo), str(clone)], check=True)
    if change == "modified":
        with open(clone / "README.md", "a") as f:
            f.write("local edit\n")
    else:
        (clone / "kernels" / "new_kernel.cc").write_text("// not committed\n")
    result = run_script("nightly.sh", str(tmp_path / "out"), repo=clone)
    assert result.returncode == 1
    assert "error: the working tree has uncommitted changes" in result.stderr
    assert "--allow-dirty" in result.stderr
    assert not (tmp_path / "out").exists()


def test_usage_errors(tmp_path):
    assert run_script("nightly.sh", "--help").stdout.startswith("usage: ci/nightly.sh")
    result = run_script("nightly.sh")
    assert result.returncode == 2 and "error: give the OUT folder" in result.stderr
    result = run_script("nightly.sh", "--builder", "make", str(tmp_path))
    assert result.returncode == 1 and "error: --builder must be pip or cibuildwheel" in result.stderr


def _wait_for_line(log: Path, text: str, proc: subprocess.Popen) -> None:
    while text not in log.read_text():
        if proc.poll() is not None:
            pytest.fail(f"nightly.sh ended before '{text}':\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_build_leaves_the_tree_clean(source_repo, tmp_path, sig):
    """Killed while the kernel cache compiles: the checkout stays as committed; on SIGTERM the
    stamped export and every compiler process are gone too."""
    tmp, out, log = tmp_path / "tmp", tmp_path / "out", tmp_path / "log"
    tmp.mkdir()
    with open(log, "w") as err:
        proc = subprocess.Popen(["bash", str(source_repo / "ci" / "nightly.sh"), str(out)],
                                env=script_env(FREETOKEN_CACHE_TARGETS="cpu", TMPDIR=str(tmp)),
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        _wait_for_line(log, "[nightly] kernel-cache wheel", proc)
        time.sleep(0.5)  # let the compilers start
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=120)
    finally:
        if sig == signal.SIGKILL or proc.poll() is None:
            _kill_session(proc.pid)
    assert rc == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert git(source_repo, "status", "--porcelain") == ""
    assert not (out / "engine-linux_x86_64.json").exists()
    if sig == signal.SIGTERM:
        assert not list(tmp.glob("freetoken-nightly.*")), "the stamped export was left behind"
        assert _session_gone(proc.pid), "compiler processes outlived nightly.sh"


def _session_gone(pgid: int, polls: int = 200) -> bool:
    for _ in range(polls):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _kill_session(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _session_gone(pgid)
