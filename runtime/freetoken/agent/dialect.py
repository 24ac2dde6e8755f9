"""How a model family writes tool calls and reasoning, chosen from its chat template and vocabulary.

No flags: the template says which dialect the model was trained on (it renders the tool list and
the examples of calls), and the vocabulary confirms the marker tokens exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

HERMES, MISTRAL, LLAMA3, JSON = "hermes", "mistral", "llama3", "json"


@dataclass(frozen=True)
class Dialect:
    """A tool-call and thinking dialect.

    name: hermes (`<tool_call>{json}</tool_call>`, Qwen and Hermes), mistral
        (`[TOOL_CALLS][{json}, ...]`), llama3 (a bare `{"name", "parameters"}` object, optionally
        after `<|python_tag|>`), json (generic fallback: a bare `{"name", "arguments"}` object).
    template_tools: the chat template renders `tools` and tool messages itself; when False the
        tool list is written into the system prompt and tool turns become plain text.
    think_open/think_close: reasoning delimiters, when the model thinks.
    """

    name: str
    template_tools: bool
    call_open: str | None = None
    call_close: str | None = None
    args_key: str = "arguments"
    think_open: str | None = None
    think_close: str | None = None

    @property
    def json_first(self) -> bool:
        """A call may be bare JSON at the start of the answer (Mistral's marker is a special
        token, which decoding drops)."""
        return self.name in (LLAMA3, JSON, MISTRAL)


def detect_dialect(template: str | None, vocab: Iterable[str]) -> Dialect:
    """The dialect a template (and the tokens in `vocab`) point to; generic JSON when nothing
    matches."""
    source = template or ""
    tokens = set(vocab)
    think = ("<think>", "</think>") if ("<think>" in source or "<think>" in tokens) else (None,
                                                                                        None)
    knows_tools = "tools" in source
    if "<tool_call>" in source:
        return Dialect(HERMES, True, "<tool_call>", "</tool_call>", "arguments", *think)
    if "[TOOL_CALLS]" in source:
        return Dialect(MISTRAL, True, "[TOOL_CALLS]", None, "arguments", *think)
    if knows_tools and ("<|python_tag|>" in source or "<|start_header_id|>" in source):
        return Dialect(LLAMA3, True, "<|python_tag|>", None, "parameters", *think)
    return Dialect(JSON, False, None, None, "arguments", *think)
