"""ci/install.sh: venv under FREETOKEN_HOME, the pinned pair, `ft` linked, `ft doctor` run."""

from __future__ import annotations

import os

import json
import socket

from tests.install.conftest import REPO, run_script, script_env


def test_help_and_bad_arguments():
    result = run_script("install.sh", "--help")
    assert result.returncode == 0 and "usage: ci/install.sh" in result.stdout
    result = run_script("install.sh", "--force")
    assert result.returncode == 2 and "error: unknown argument '--force'" in result.stderr


def test_asks_before_installing_and_needs_yes_without_a_terminal(tmp_path):
    env = script_env(FREETOKEN_HOME=str(tmp_path / "home"), XDG_BIN_HOME=str(tmp_path / "bin"))
    result = run_script("install.sh", env=env, stdin=open(os.devnull), start_new_session=True)
    assert result.returncode == 1 and "run again with --yes" in result.stderr
    assert not (tmp_path / "home").exists() and not (tmp_path / "bin").exists()


def test_refuses_to_replace_a_foreign_ft(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ft").write_text("#!/bin/sh\n")
    env = script_env(FREETOKEN_HOME=str(tmp_path / "home"), XDG_BIN_HOME=str(tmp_path / "bin"))
    result = run_script("install.sh", "--yes", env=env)
    assert result.returncode == 1 and "is not a link this script made" in result.stderr
    assert (tmp_path / "bin" / "ft").read_text() == "#!/bin/sh\n"


def test_installs_links_ft_and_runs_doctor(installed_pair, nightly_pair, tmp_path):
    """Into the home whose venv already holds torch (a fresh one would download CUDA torch);
    run twice: the second run re-verifies and changes nothing."""
    bin_dir = tmp_path / "bin"
    env = script_env(FREETOKEN_HOME=str(installed_pair.home), XDG_BIN_HOME=str(bin_dir))
    for _ in range(2):
        result = run_script("install.sh", "--yes", "--manifest", installed_pair.manifest_url,
                            env=env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert os.readlink(bin_dir / "ft") == str(installed_pair.venv / "bin" / "ft")
        assert "== ft doctor ==" in result.stdout
        assert f"freetoken {nightly_pair.manifest['version']}" in result.stdout
        assert "pairing with runtime: ok" in result.stdout
        assert "next: ft serve" in result.stdout
        assert f"note: {bin_dir} is not on PATH" in result.stdout


def test_unreachable_release_fails_with_one_line_naming_the_url_and_the_fix(tmp_path):
    """The root manifest with its release host swapped for a closed loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    manifest = json.loads((REPO / "engine-manifest.json").read_text())
    for key in ("runtime", "kernel_cache"):
        manifest[key]["url"] = f"{closed}/nightly/{manifest[key]['name']}"
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    env = script_env(FREETOKEN_HOME=str(tmp_path / "home"), XDG_BIN_HOME=str(tmp_path / "bin"))
    result = run_script("install.sh", "--yes", "--manifest", str(tmp_path / "m.json"), env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert f"cannot reach {manifest['runtime']['url']}" in errors[0]
    assert "--manifest" in errors[0] and "Traceback" not in result.stderr
