"""Generated text as Responses API output items (reasoning, message, function_call, in the
order the model produced them) and the stream events that build them: one item is open at a
time, and a new kind of parser event closes it."""

from __future__ import annotations

from freetoken.agent.parser import Content, Event, OutputParser, Reasoning, ToolCall
from freetoken.server.sse import new_id, sse_event


class OutputBuilder:
    """Feed one request's text with `feed`; `items` is the response's `output` so far.
    `event` numbers every event of the stream (sequence_number), the route's own included."""

    def __init__(self, parser: OutputParser | None):
        self.parser = parser
        self.items: list[dict] = []
        self.reasoning = ""        # all reasoning text, for usage.reasoning_tokens
        self.seq = 0
        self.open: dict | None = None
        self.text = ""             # the open item's text so far

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return sse_event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def feed(self, text: str, final: bool, incomplete: bool = False) -> list[str]:
        """The events of a piece of text; when final, the open item closes ("incomplete" when
        max_output_tokens cut it) and an answer with no item gets an empty message."""
        out: list[str] = []
        for event in self._events(text, final):
            if isinstance(event, ToolCall):
                out += self._close("completed") + self._call(event)
                continue
            kind = "reasoning" if isinstance(event, Reasoning) else "message"
            if self.open is None or self.open["type"] != kind:
                out += self._close("completed") + self._open(kind)
            out.append(self._delta(event.text))
        if final:
            if not self.items:
                out += self._open("message")
            out += self._close("incomplete" if incomplete else "completed")
        return out

    def _events(self, text: str, final: bool) -> list[Event]:
        if self.parser is None:
            return [Content(text)] if text else []
        events = self.parser.feed(text) if text else []
        return events + (self.parser.finish() if final else [])

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _open(self, kind: str) -> list[str]:
        if kind == "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": []}
        else:
            item = {"id": new_id("msg_"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
        self.items.append(item)
        self.open, self.text = item, ""
        added = self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=item)
        if kind == "reasoning":
            return [added, self.event("response.reasoning_summary_part.added", **self._where(),
                                      summary_index=0, part=summary_part(""))]
        return [added, self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=text_part(""))]

    def _delta(self, text: str) -> str:
        self.text += text
        if self.open["type"] == "reasoning":
            self.reasoning += text
            return self.event("response.reasoning_summary_text.delta", **self._where(),
                              summary_index=0, delta=text)
        return self.event("response.output_text.delta", **self._where(), content_index=0,
                          delta=text, logprobs=[])

    def _close(self, status: str) -> list[str]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        if item["type"] == "reasoning":
            item["summary"] = [summary_part(self.text)]
            out = [self.event("response.reasoning_summary_text.done", **where, summary_index=0,
                              text=self.text),
                   self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                              part=summary_part(self.text))]
        else:
            item.update(status=status, content=[text_part(self.text)])
            out = [self.event("response.output_text.done", **where, content_index=0,
                              text=self.text, logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=text_part(self.text))]
        self.open = None
        return out + [self.event("response.output_item.done",
                                 output_index=where["output_index"], item=item)]

    def _call(self, call: ToolCall) -> list[str]:
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": new_id("call_"), "name": call.name}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = [self.event("response.output_item.added", output_index=where["output_index"],
                          item=item),
               self.event("response.function_call_arguments.delta", **where,
                          delta=call.arguments),
               self.event("response.function_call_arguments.done", **where,
                          arguments=call.arguments)]
        item.update(arguments=call.arguments, status="completed")
        return out + [self.event("response.output_item.done",
                                 output_index=where["output_index"], item=item)]


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def summary_part(text: str) -> dict:
    return {"type": "summary_text", "text": text}
