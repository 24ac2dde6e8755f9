"""One JSON object from a model folder, with errors that name the file. Torch-free, so the
start-up memory plan and the tokenizer can read a folder's settings before torch loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freetoken.models.errors import ModelFormatError


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object from `path` ({} when optional and absent)."""
    if not path.is_file():
        if required:
            raise ModelFormatError(f"{path}: missing; an HF model directory needs config.json, "
                                   f"*.safetensors and tokenizer.json")
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return value
