"""OpenAI chat replies from parser events: `message.reasoning_content`, `message.tool_calls`
with `finish_reason: "tool_calls"`, and the streamed deltas OpenAI sends for them (one index
per call: id, type and name first, then the arguments)."""

from __future__ import annotations

from freetoken.agent.parser import Content, Event, OutputParser, Reasoning, ToolCall
from freetoken.server.sse import new_id


class ChatShaper:
    """Turns one request's generated text into OpenAI message fields and stream deltas."""

    def __init__(self, parser: OutputParser | None):
        self.parser = parser
        self.ids: dict[int, str] = {}

    @property
    def made_calls(self) -> bool:
        return bool(self.parser is not None and self.parser.calls)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.made_calls and reason in ("stop", "length") else reason

    def message(self, text: str) -> dict:
        """The non-streamed assistant message for the whole text."""
        if self.parser is None:
            return {"role": "assistant", "content": text, "refusal": None}
        events = self.parser.feed(text) + self.parser.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls = [self._call(e) for e in events if isinstance(e, ToolCall)]
        message: dict = {"role": "assistant", "content": content or (None if calls else ""),
                         "refusal": None}   # OpenAI's schema requires it: null when none
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def deltas(self, text: str, final: bool) -> list[dict]:
        """Stream deltas for a piece of text (and, when final, whatever was held back)."""
        if self.parser is None:
            return [{"content": text}] if text else []
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        out: list[dict] = []
        for event in events:
            out.extend(self._delta(event))
        return out

    def _delta(self, event: Event) -> list[dict]:
        if isinstance(event, Reasoning):
            return [{"reasoning_content": event.text}]
        if isinstance(event, Content):
            return [{"content": event.text}]
        call = self._call(event)
        head = {"index": event.index, "id": call["id"], "type": "function",
                "function": {"name": event.name, "arguments": ""}}
        return [{"tool_calls": [head]},
                {"tool_calls": [{"index": event.index,
                                 "function": {"arguments": event.arguments}}]}]

    def _call(self, event: ToolCall) -> dict:
        call_id = self.ids.setdefault(event.index, new_id("call_"))
        return {"id": call_id, "type": "function",
                "function": {"name": event.name, "arguments": event.arguments}}
