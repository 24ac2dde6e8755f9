"""ci/cibuildwheel.toml: cibuildwheel accepts it and selects the one kernel-cache build."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.install.conftest import REPO

CONFIG = REPO / "ci" / "cibuildwheel.toml"


@pytest.fixture(scope="module")
def cibuildwheel() -> str:
    """The cibuildwheel command, installed into this environment when missing."""
    found = shutil.which("cibuildwheel", path=str(Path(sys.executable).parent))
    if found:
        return found
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cibuildwheel>=4,<5"],
                            capture_output=True, text=True)
    found = shutil.which("cibuildwheel", path=str(Path(sys.executable).parent))
    if not found:
        pytest.skip(f"cibuildwheel could not be installed (no package index?): {result.stderr[-500:]}")
    return found


def _identifiers(cibuildwheel: str, config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([cibuildwheel, "--print-build-identifiers", "--platform", "linux",
                           "--config-file", str(config), "kernel-cache"],
                          cwd=REPO, capture_output=True, text=True)


def test_config_selects_one_manylinux_x86_64_build(cibuildwheel):
    result = _identifiers(cibuildwheel, CONFIG)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cp312-manylinux_x86_64"]


def test_a_misspelt_option_is_caught(cibuildwheel, tmp_path):
    """The check above is real: cibuildwheel refuses options it does not know."""
    bad = tmp_path / "bad.toml"
    bad.write_text(CONFIG.read_text().replace("\narchs =", "\narchz ="))
    result = _identifiers(cibuildwheel, bad)
    assert result.returncode != 0 and "archz" in result.stderr

