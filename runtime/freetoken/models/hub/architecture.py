"""Refuse a model of an architecture FreeToken lacks before its weights are downloaded: from
config.json (fetched first, it is small) or from the GGUF header, read with a ranged request.
The supported list is the model registry's own (models/registry.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from freetoken.models.errors import UnsupportedModelError

# The first bytes of a GGUF file read for its header: the general.* keys (architecture first,
# as llama.cpp's converters write them) come before the vocabulary, in the first kilobytes.
HEADER_BYTES = 256 * 1024
_log = logging.getLogger("freetoken.models.hub")


def _refuse(exc: UnsupportedModelError) -> UnsupportedModelError:
    return UnsupportedModelError(f"{exc}; nothing large was downloaded")


def check_hf_config(config_file: Path, source: str) -> None:
    """config.json names an architecture (and settings) the HF loader supports."""
    from freetoken.models.checkpoint.hf_config import config_from_hf
    from freetoken.models.checkpoint.json_file import read_json

    try:
        config_from_hf(read_json(config_file), source)
    except UnsupportedModelError as exc:
        raise _refuse(exc) from None


def check_gguf_header(header: bytes, source: str) -> None:
    """The GGUF whose first bytes are `header` declares a supported architecture (a header
    that does not show it is left to the loader)."""
    from freetoken.models.checkpoint.gguf_file import GGUFParseError, read_metadata_prefix
    from freetoken.models.errors import ModelFormatError
    from freetoken.models.registry import spec_for_gguf

    try:
        meta = read_metadata_prefix(header)
    except GGUFParseError as exc:
        raise ModelFormatError(f"{source}: not a GGUF file ({exc})") from None
    arch = meta.get("general.architecture")
    if arch is None:
        _log.debug("%s: no general.architecture in the first %d bytes", source, len(header))
        return
    experts = int(meta.get(f"{arch}.expert_count") or 0) > 0
    try:
        spec_for_gguf(str(arch), source, has_experts=experts)
    except UnsupportedModelError as exc:
        raise _refuse(exc) from None


def read_remote_header(repo_id: str, path: str, commit: str) -> bytes:
    """The first HEADER_BYTES of a file in the repository, by an HTTP range request (a server
    that ignores the range is read only that far)."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo_id, path, revision=commit, endpoint=constants.ENDPOINT)
    headers = {**build_hf_headers(), "Range": f"bytes=0-{HEADER_BYTES - 1}"}
    data = bytearray()
    with get_session().stream("GET", url, headers=headers,
                              timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
        hf_raise_for_status(response)
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) >= HEADER_BYTES:
                break
    return bytes(data[:HEADER_BYTES])
