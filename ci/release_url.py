"""Print the release location nightly pairs are published under (FREETOKEN_RELEASE_URL, else
the default named in runtime/freetoken/env.py). Loads env.py by path: no install needed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ENV_PY = Path(__file__).resolve().parent.parent / "runtime" / "freetoken" / "env.py"


def release_url() -> str:
    spec = importlib.util.spec_from_file_location("freetoken_env", ENV_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module.read().release_url


if __name__ == "__main__":
    try:
        print(release_url())
    except ValueError as exc:   # EnvError: a bad FREETOKEN_* value, named in the message
        sys.exit(f"error: {exc}")
