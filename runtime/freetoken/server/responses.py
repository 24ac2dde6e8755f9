"""OpenAI Responses API route: POST /v1/responses (the Response object, or its event stream),
stateless: over the chat machinery of /v1/chat/completions (template, tool calls, thinking,
constrained decoding, admission), nothing stored."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from freetoken.engine.request import RequestOutput, Usage
from freetoken.engine.stream import RequestStream
from freetoken.server.context import ServerContext, agent_errors, collect
from freetoken.server.images import prepare_chat
from freetoken.server.metrics import RequestTimer
from freetoken.server.openai import stream_error
from freetoken.server.protocol import parse_body
from freetoken.server.responses_input import check_supported, responses_agent_request
from freetoken.server.responses_output import OutputBuilder
from freetoken.server.responses_protocol import ResponsesRequest
from freetoken.server.sse import new_id, sse_response

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, ResponsesRequest)
    ctx.check_model(body.model)
    check_supported(body)
    max_tokens = ctx.output_limit(body.max_output_tokens, "max_output_tokens")
    params = body.sampling_params(max_tokens)
    with agent_errors():
        agent_request = responses_agent_request(body)
    prepared, images = await prepare_chat(ctx, agent_request, max_tokens)
    timer = ctx.metrics.timer()
    stream = ctx.submit(prepared.prompt_ids, params, timer, prepared.guide, images)
    builder = OutputBuilder(prepared.parser)
    snapshot = Snapshot(ctx, body, builder, max_tokens)
    if body.stream:
        response = sse_response(response_events(stream, timer, builder, snapshot))
        response.background = BackgroundTask(stream.abort)  # also when the body never started
        return response
    text, last, _ = await collect(request, stream, timer)
    builder.feed(text, final=True, incomplete=last.finish_reason == "length")
    return JSONResponse(snapshot(last))


class Snapshot:
    """The Response object at a point of the request: in_progress (no output yet), then
    completed, incomplete (max_output_tokens reached) or failed, with the output and usage."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, builder: OutputBuilder,
                 max_tokens: int | None):
        self.ctx, self.body, self.builder = ctx, body, builder
        self.id, self.created = new_id("resp_"), int(time.time())
        self.max_tokens = max_tokens

    def __call__(self, last: RequestOutput | None = None, error: dict | None = None) -> dict:
        body = self.body
        status = ("in_progress" if last is None else "failed" if error
                  else "incomplete" if last.finish_reason == "length" else "completed")
        fmt = body.text.format if body.text else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "background": False, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": body.instructions, "max_output_tokens": self.max_tokens,
            "max_tool_calls": None, "model": self.ctx.model_name,
            "output": self.builder.items if last is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None},
            "service_tier": "default", "store": False, "temperature": body.temperature,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                                else {"type": "text"}),
                     "verbosity": (body.text.verbosity if body.text else None) or "medium"},
            "tool_choice": (body.tool_choice.model_dump() if body.tool_choice is not None
                            and not isinstance(body.tool_choice, str)
                            else body.tool_choice or "auto"),
            "tools": [t.model_dump() for t in body.tools or ()], "top_logprobs": 0,
            "top_p": body.top_p, "truncation": body.truncation or "disabled",
            "usage": None if last is None or error else self.usage(last.usage),
            "user": body.user, "metadata": body.metadata or {}}

    def usage(self, usage: Usage) -> dict:
        """Usage as OpenAI counts it; writing the prefix cache costs nothing here, so
        cache_write_tokens is 0, and reasoning_tokens counts the reasoning text's tokens."""
        reasoning = self.builder.reasoning
        thought = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) \
            if reasoning else 0
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": min(thought,
                                                                  usage.completion_tokens)},
                "total_tokens": usage.total_tokens}


async def response_events(stream: RequestStream, timer: RequestTimer, builder: OutputBuilder,
                          snapshot: Callable[..., dict]) -> AsyncIterator[str]:
    """response.created, response.in_progress, each item's events (output_item.added, its
    parts and deltas, output_item.done), then response.completed or response.incomplete; a
    request the engine failed or the server ended gets response.failed (with the output so
    far) instead. Leaving early aborts."""
    try:
        yield builder.event("response.created", response=snapshot())
        yield builder.event("response.in_progress", response=snapshot())
        async for output in stream:
            timer.on_output(output)
            if output.finish_reason in ("error", "abort"):   # the client did not abort it
                error = {"code": "server_error",
                         "message": stream_error(output)["error"]["message"]}
                yield builder.event("response.failed", response=snapshot(output, error))
                return
            incomplete = output.finish_reason == "length"
            for event in builder.feed(output.text, output.finished, incomplete):
                yield event
            if output.finished:
                done = snapshot(output)
                yield builder.event(f"response.{done['status']}", response=done)
    finally:
        stream.abort()
