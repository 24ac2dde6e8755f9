"""Anthropic-compatible routes: POST /v1/messages (plain JSON and the event stream) and
POST /v1/messages/count_tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from freetoken.agent.parser import Content, Event, OutputParser, Reasoning, ToolCall
from freetoken.engine.request import RequestOutput, Usage
from freetoken.engine.stream import RequestStream
from freetoken.server.adapters import anthropic_agent_request
from freetoken.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from freetoken.server.context import ServerContext, agent_errors, collect
from freetoken.server.images import count_prompt_tokens, prepare_chat
from freetoken.server.metrics import RequestTimer
from freetoken.server.protocol import parse_body
from freetoken.server.sse import new_id, sse_event, sse_response

router = APIRouter()


def stop_fields(output: RequestOutput, tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the final output."""
    if tool_use:
        return "tool_use", None
    if output.finish_reason == "length":
        return "max_tokens", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, CountTokensRequest)
    ctx.check_model(body.model)
    with agent_errors():
        agent_request = anthropic_agent_request(body, None)
    return {"input_tokens": await count_prompt_tokens(ctx, agent_request)}


@router.post("/v1/messages")
async def messages(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, MessagesRequest)
    ctx.check_model(body.model)
    max_tokens = ctx.output_limit(body.max_tokens, "max_tokens")
    params = body.sampling_params(max_tokens)
    with agent_errors():
        agent_request = anthropic_agent_request(body, body.max_tokens)
    prepared, images = await prepare_chat(ctx, agent_request, max_tokens)
    timer = ctx.metrics.timer()
    stream = ctx.submit(prepared.prompt_ids, params, timer, prepared.guide, images)
    message_id = new_id("msg_")
    blocks = BlockBuilder(prepared.parser)
    if body.stream:
        response = sse_response(message_events(stream, timer, message_id, ctx.model_name,
                                               len(prepared.prompt_ids), blocks))
        response.background = BackgroundTask(stream.abort)
        return response
    text, last, _ = await collect(request, stream, timer)
    content = blocks.content(text)
    stop_reason, stop_sequence = stop_fields(last, blocks.tool_use)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": usage_dict(last.usage)})


def usage_dict(usage: Usage) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens (their sum is
    the prompt); nothing is charged for writing the cache, so cache_creation_input_tokens is 0."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


class BlockBuilder:
    """Parser events as Anthropic content blocks: thinking, text and tool_use, in order; as a
    stream, one block is open at a time and a new kind of event closes it."""

    def __init__(self, parser: OutputParser | None):
        self.parser = parser
        self.tool_use = False
        self.index = -1
        self.open_kind: str | None = None

    def _events(self, text: str, final: bool) -> list[Event]:
        if self.parser is None:
            return [Content(text)] if text else []
        events = self.parser.feed(text) if text else []
        return events + (self.parser.finish() if final else [])

    def content(self, text: str) -> list[dict]:
        blocks: list[dict] = []
        for event in self._events(text, final=True):
            kind = _kind(event)
            if kind == "tool_use":
                self.tool_use = True
                blocks.append({"type": "tool_use", "id": new_id("toolu_"), "name": event.name,
                               "input": json.loads(event.arguments)})
            elif blocks and blocks[-1]["type"] == kind:
                blocks[-1][kind] += event.text
            else:
                blocks.append({"type": kind, kind: event.text} if kind == "text" else
                              {"type": "thinking", "thinking": event.text, "signature": ""})
        return blocks or [{"type": "text", "text": ""}]

    def stream(self, text: str, final: bool) -> list[str]:
        out: list[str] = []
        for event in self._events(text, final):
            kind = _kind(event)
            if kind != self.open_kind or kind == "tool_use":
                out += self._close() + self._open(event, kind)
            if kind == "tool_use":
                self.tool_use = True
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": event.arguments}))
            elif kind == "text":
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            else:
                out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        if final:
            if self.index < 0:
                out += self._open(Content(""), "text")
            out += self._close()
        return out

    def begin(self) -> list[str]:
        """Plain text (no parser) opens its one block at once, as Anthropic does."""
        return self._open(Content(""), "text") if self.parser is None else []

    def _open(self, event: Event, kind: str) -> list[str]:
        self.index += 1
        self.open_kind = kind
        block = ({"type": "tool_use", "id": new_id("toolu_"), "name": event.name, "input": {}}
                 if kind == "tool_use" else {"type": "text", "text": ""} if kind == "text"
                 else {"type": "thinking", "thinking": "", "signature": ""})
        return [sse_event("content_block_start", {"type": "content_block_start",
                                                  "index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse_event("content_block_stop", {"type": "content_block_stop",
                                                 "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.index, "delta": delta})


def _kind(event: Event) -> str:
    if isinstance(event, ToolCall):
        return "tool_use"
    return "thinking" if isinstance(event, Reasoning) else "text"


def stream_error(output: RequestOutput) -> dict:
    """The error event that ends a stream the engine failed (api_error) or the server ended
    while shutting down (overloaded_error: retry elsewhere), in Anthropic's error shape."""
    if output.finish_reason == "error":
        return {"type": "error", "error": {"type": "api_error",
                                           "message": f"generation failed: {output.error}"}}
    reason = output.error or "the server is stopping"
    return {"type": "error", "error": {"type": "overloaded_error",
                                       "message": f"the request was aborted: {reason}"}}


async def message_events(stream: RequestStream, timer: RequestTimer, message_id: str,
                         model: str, prompt_tokens: int,
                         blocks: BlockBuilder) -> AsyncIterator[str]:
    """message_start, ping (after the first block's start when the text is plain), then per
    block content_block_start, content_block_delta...,
    content_block_stop, then message_delta (stop_reason, output_tokens), message_stop; a
    request the engine failed or the server ended gets an error event instead of the end.
    Leaving early aborts."""
    message = {"id": message_id, "type": "message", "role": "assistant", "content": [],
               "model": model, "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0, "output_tokens": 0}}
    try:
        yield sse_event("message_start", {"type": "message_start", "message": message})
        for event in blocks.begin():
            yield event
        yield sse_event("ping", {"type": "ping"})
        async for output in stream:
            timer.on_output(output)
            if output.finish_reason in ("error", "abort"):   # the client did not abort it
                yield sse_event("error", stream_error(output))
                return
            for event in blocks.stream(output.text, output.finished):
                yield event
            if output.finished:
                stop_reason, stop_sequence = stop_fields(output, blocks.tool_use)
                yield sse_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage_dict(output.usage)})  # cumulative, cache reads known now
                yield sse_event("message_stop", {"type": "message_stop"})
    finally:
        stream.abort()
