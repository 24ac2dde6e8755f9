"""The one place a model argument becomes local paths, before anything loads: a local file or
folder as given (an existing path wins), or a Hugging Face Hub repository ORG/NAME[:QUANT]
fetched into the Hugging Face cache (models/hub/). Loaders only ever see paths."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from freetoken.models.errors import ModelFormatError, ModelOptionError


@dataclass(frozen=True)
class ResolvedModel:
    """What load_model takes, and the id to serve it under."""

    path: str | None    # a GGUF file, an HF folder, or None for the embedded default model
    name: str | None    # ORG/NAME[:QUANT] for a Hub model; None: the loader names it


def _to_stderr(message: str) -> None:
    print(f"freetoken: {message}", file=sys.stderr, flush=True)


def resolve_model(argument: str | None,
                  say: Callable[[str], None] = _to_stderr) -> ResolvedModel:
    """Resolve `argument` (--model) to local paths; Hub files are fetched as needed.

    Args:
        argument: a path, ORG/NAME[:QUANT], or None (the embedded default, left to the loader).
        say: where progress lines go (stderr by default).
    Raises:
        ModelFormatError (neither a path nor a repository name), ModelDownloadError (the Hub
        answered no, or cannot be reached and the cache lacks the model), ModelOptionError (no
        file matches :QUANT), UnsupportedModelError (an architecture FreeToken lacks, found
        before the weights are downloaded).
    """
    if argument is None or Path(argument).expanduser().exists():
        return ResolvedModel(argument, None)
    from freetoken.models.hub.reference import parse_reference

    ref = parse_reference(argument)
    if ref is None:
        raise ModelFormatError(f"{argument}: no such file or directory; pass a .gguf file, an "
                               f"HF model directory or a Hugging Face repository "
                               f"ORG/NAME[:QUANT]")
    if importlib.util.find_spec("huggingface_hub") is None:   # the Hub client, for names only
        raise ModelOptionError(f"{argument}: fetching a model by name needs huggingface_hub, "
                               f"which is not installed; fix: pip install "
                               f"'huggingface-hub>=2.4,<3', or pass a local path")
    from freetoken.models.hub.pull import pull

    return ResolvedModel(str(pull(ref, say)), ref.label)
