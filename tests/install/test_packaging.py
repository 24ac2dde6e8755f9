"""The runtime wheel ships every package of runtime/freetoken: the package list in
pyproject.toml is explicit, so a new subpackage missing from it would install without its code."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_runtime_package_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    root = REPO / "runtime"
    found = {".".join(init.parent.relative_to(root).parts)
             for init in root.joinpath("freetoken").rglob("__init__.py")}
    assert found, "no packages found under runtime/freetoken"
    missing = sorted(found - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
