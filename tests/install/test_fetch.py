"""ci/fetch-nightly-pair.sh on small fake pairs: what it installs, and every refusal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.install.conftest import run_script, script_env
from tests.install.wheels import fake_pair, flip_byte, manifest_for, restamp

COMMIT = "0123456ab"


def _release(folder: Path, **kwargs) -> Path:
    """A release folder: a fake pair and its manifest with relative urls."""
    runtime, cache = fake_pair(folder, COMMIT, **kwargs)
    manifest = folder / "engine-linux_x86_64.json"
    manifest.write_text(json.dumps(manifest_for(runtime, cache, COMMIT, kwargs.get("cuda"))))
    return manifest


def _installed(venv: Path) -> dict[str, str]:
    """{distribution: version} in a venv, read from its dist-info folders."""
    found = {}
    for info in venv.glob("lib/python*/site-packages/*.dist-info"):
        name, version = info.name[: -len(".dist-info")].split("-", 1)
        found[name] = version
    return found


@pytest.fixture
def empty_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def test_help_and_bad_arguments():
    result = run_script("fetch-nightly-pair.sh", "--help")
    assert result.returncode == 0 and "usage: ci/fetch-nightly-pair.sh" in result.stdout
    result = run_script("fetch-nightly-pair.sh", "--bogus")
    assert result.returncode == 2 and "error: unknown argument '--bogus'" in result.stderr


def test_installs_the_pair_over_http_and_a_rerun_is_harmless(tmp_path, release_server,
                                                             empty_venv):
    base = release_server.publish(_release(tmp_path / "rel").parent, "fake-ok")
    venv = empty_venv
    for _ in range(2):
        result = run_script("fetch-nightly-pair.sh", "--manifest", base + "engine-linux_x86_64.json",
                            "--venv", str(venv))
        assert result.returncode == 0, result.stderr
        assert _installed(venv)["freetoken"] == f"0.1.0+g{COMMIT}"
        assert _installed(venv)["freetoken_kernel_cache"] == f"0.1.0+g{COMMIT}"


def test_pip_fallback_creates_the_venv_and_installs_from_a_manifest_path(tmp_path):
    manifest = _release(tmp_path / "rel", cuda="13.0")
    venv = tmp_path / "venv"  # created by the script
    result = run_script("fetch-nightly-pair.sh", "--manifest", str(manifest), "--venv", str(venv),
                        env=script_env(FREETOKEN_INSTALLER="pip"))
    assert result.returncode == 0, result.stderr
    assert _installed(venv)["freetoken_kernel_cache"] == f"0.1.0+cu130.g{COMMIT}"


def _refused(manifest: str, venv: Path) -> str:
    before = _installed(venv) if venv.exists() else None
    result = run_script("fetch-nightly-pair.sh", "--manifest", manifest, "--venv", str(venv))
    assert result.returncode == 1, result.stderr
    assert "nothing was installed" in result.stderr
    assert (_installed(venv) if venv.exists() else None) == before
    return result.stderr


@pytest.mark.parametrize("damage, message", [
    (lambda p: flip_byte(p), "sha256"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1]), "size"),
    (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "size more than"),
    (lambda p: p.unlink(), "No such file"),
])
def test_damaged_cache_wheel_is_refused(tmp_path, empty_venv, damage, message):
    manifest = _release(tmp_path / "rel")
    (cache,) = manifest.parent.glob("freetoken_kernel_cache-*.whl")
    damage(cache)
    assert message in _refused(str(manifest), empty_venv)
    assert message in _refused(str(manifest), tmp_path / "not-created")
    assert not (tmp_path / "not-created").exists()


def test_mismatched_stamps_are_refused(tmp_path, empty_venv):
    runtime, _ = fake_pair(tmp_path, COMMIT)
    _, other_cache = fake_pair(tmp_path / "other", COMMIT, cache_commit="fedcba987")
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(manifest_for(runtime, other_cache, COMMIT)))
    assert "stamps do not match" in _refused(str(manifest), empty_venv)


def test_renamed_wheel_is_refused(tmp_path, empty_venv):
    runtime, cache = fake_pair(tmp_path, COMMIT)
    (tmp_path / "other").mkdir()
    other = restamp(cache, tmp_path / "other", f"0.1.0+g{'9' * 9}")
    cache.write_bytes(other.read_bytes())  # the right name outside, another build inside
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(manifest_for(runtime, cache, COMMIT)))
    assert "renamed" in _refused(str(manifest), empty_venv)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(schema=2), "schema 2"),
    (lambda m: m.update(platform="macosx_arm64"), "platform"),
    (lambda m: m.update(version="0.1.0+g111111111"), "manifest version"),
    (lambda m: m.update(cuda="13.0"), "holds no CUDA kernels"),
    (lambda m: m["runtime"].update(sha256="00" * 31), "64 lowercase hex"),
    (lambda m: m["runtime"].update(name="../../evil.whl"), "not a wheel file name"),
    (lambda m: m["kernel_cache"].update(url="http://127.0.0.1:9/missing.whl"),
     "cannot reach http://127.0.0.1:9/missing.whl ("),
    (lambda m: m.pop("kernel_cache"), "no 'kernel_cache' entry"),
])
def test_bad_manifest_is_refused(tmp_path, empty_venv, edit, message):
    manifest = _release(tmp_path / "rel")
    data = json.loads(manifest.read_text())
    edit(data)
    manifest.write_text(json.dumps(data))
    assert message in _refused(str(manifest), empty_venv)


def test_unreachable_manifest_is_refused(tmp_path, release_server, empty_venv):
    assert "HTTP 404" in _refused(release_server.url + "/nope/engine.json", empty_venv)
    (tmp_path / "bad.json").write_text("{not json")
    assert "not valid JSON" in _refused(str(tmp_path / "bad.json"), empty_venv)
