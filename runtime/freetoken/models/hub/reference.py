"""A Hub model as the command line names it: ORG/NAME, optionally :QUANT (llama.cpp's -hf)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The Hub's repo ids: an owner and a name of letters, digits, '.', '_' and '-'. The tag after
# ':' is matched against GGUF file names (gguf_pick.py), as llama.cpp matches its -hf tag.
_REFERENCE = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+)"
                        r"(?::(?P<quant>[A-Za-z0-9._-]+))?$")


@dataclass(frozen=True)
class HubReference:
    """ORG/NAME and the GGUF quantization asked for (None: the default pick)."""

    repo_id: str
    quant: str | None = None

    @property
    def label(self) -> str:
        """The name as the user wrote it (also the served model id)."""
        return self.repo_id + (f":{self.quant}" if self.quant else "")


def parse_reference(text: str) -> HubReference | None:
    """The reference `text` spells, or None when it is not of the form ORG/NAME[:QUANT]."""
    match = _REFERENCE.match(text.strip())
    if match is None:
        return None
    return HubReference(match["repo"], match["quant"])
