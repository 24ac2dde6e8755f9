"""The streaming output parser: generated text in, reasoning / content / tool calls out.

One state machine for every protocol adapter. Text that might be the start of a marker
(`<think>`, `</think>`, `<tool_call>`, ...) is held back until it is ruled in or out, so a
marker never leaks into the content; a tool call is released once it is complete (id and name
first, then its arguments), as the OpenAI and Anthropic streams send them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from freetoken.agent.dialect import Dialect


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int
    name: str
    arguments: str      # a JSON object, as a string


Event = Reasoning | Content | ToolCall

START, THINK, ANSWER_START, TEXT, CALL, TAIL = range(6)


class OutputParser:
    """Feed text deltas with `feed`, end with `finish`; both return the events now final.

    tool_names: the tools the request offered (None: no tools, so calls are never parsed);
    in_thinking: the prompt already opened the think block; max_calls: calls past this many
    are dropped (parallel_tool_calls false).
    """

    def __init__(self, dialect: Dialect, tool_names: set[str] | None = None,
                 in_thinking: bool = False, max_calls: int | None = None):
        self.dialect = dialect
        self.tool_names = tool_names
        self.max_calls = max_calls
        self.state = THINK if in_thinking and dialect.think_close else START
        self.buffer = ""
        self.opened = ""        # the call marker that started the buffered tail, if any
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            before = (self.state, len(self.buffer))
            step = (self._start, self._think, self._answer_start, self._text, self._call,
                    self._tail)[self.state]
            events.extend(step(final))
            if (self.state, len(self.buffer)) == before:
                return [e for e in events if not isinstance(e, (Reasoning, Content)) or e.text]

    # ---- states ----------------------------------------------------------------------------

    def _start(self, final: bool) -> list[Event]:
        opener = self.dialect.think_open
        stripped = self.buffer.lstrip()
        if opener and stripped.startswith(opener):
            self.buffer = stripped[len(opener):]
            self.state = THINK
        elif opener and opener.startswith(stripped) and not final:
            pass                                    # maybe the opener, still arriving
        else:
            self.state = ANSWER_START
        return []

    def _think(self, final: bool) -> list[Event]:
        closer = self.dialect.think_close or ""
        at = self.buffer.find(closer) if closer else -1
        if at >= 0:
            text, self.buffer = self.buffer[:at], self.buffer[at + len(closer):]
            self.state = ANSWER_START
            return [Reasoning(text)]
        keep = 0 if final else _partial_suffix(self.buffer, (closer,))
        return [Reasoning(self._take(len(self.buffer) - keep))]

    def _answer_start(self, final: bool) -> list[Event]:
        stripped = self.buffer.lstrip()
        if not stripped and not final:
            return []
        self.buffer = stripped
        if self.tool_names is not None and self.dialect.json_first and stripped[:1] in ("{",
                                                                                         "["):
            self.state = TAIL
        else:
            self.state = TEXT
        return []

    def _text(self, final: bool) -> list[Event]:
        opener = self.dialect.call_open if self.tool_names is not None else None
        at = self.buffer.find(opener) if opener else -1
        if at >= 0:
            text = self._take(at)
            self.buffer = self.buffer[len(opener):]
            self.opened = opener
            self.state = CALL if self.dialect.call_close else TAIL
            return [Content(text)]
        keep = 0 if final or not opener else _partial_suffix(self.buffer, (opener,))
        return [Content(self._take(len(self.buffer) - keep))]

    def _call(self, final: bool) -> list[Event]:
        closer = self.dialect.call_close
        at = self.buffer.find(closer)
        if at < 0 and not final:
            return []
        body = self.buffer if at < 0 else self.buffer[:at]
        self.buffer = "" if at < 0 else self.buffer[at + len(closer):]
        self.state = ANSWER_START    # the whitespace between calls is not content
        calls = self._calls_from(body)
        if calls is None:   # not a call after all: show what the model wrote
            return [Content(self.dialect.call_open + body + ("" if at < 0 else closer))]
        return calls

    def _tail(self, final: bool) -> list[Event]:
        if not final:
            return []
        body, self.buffer = self.buffer, ""
        self.state = TEXT
        calls = self._calls_from(body)
        if calls is None:
            return [Content(self.opened + body)]
        return calls

    # ---- helpers ---------------------------------------------------------------------------

    def _take(self, size: int) -> str:
        text, self.buffer = self.buffer[:size], self.buffer[size:]
        return text

    def _calls_from(self, body: str) -> list[ToolCall] | None:
        """The calls a body holds, or None when it is not a well-formed call of offered
        tools."""
        found = parse_calls(body.strip(), self.dialect.args_key)
        if not found or any(name not in (self.tool_names or ()) for name, _ in found):
            return None
        calls = []
        for name, arguments in found:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break
            calls.append(ToolCall(len(self.calls), name, arguments))
            self.calls.append(calls[-1])
        return calls


def parse_calls(body: str, args_key: str) -> list[tuple[str, str]] | None:
    """[(name, JSON arguments)] from a JSON call, a list of them, or Mistral's
    `name[ARGS]{...}`; None when the body is none of these."""
    if "[ARGS]" in body:
        name, _, args = body.partition("[ARGS]")
        body = json.dumps({"name": name.strip(), "arguments": _loads(args)})
    value = _loads(body)
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = next((item[k] for k in (args_key, "arguments", "parameters") if k in item),
                         {})
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest
