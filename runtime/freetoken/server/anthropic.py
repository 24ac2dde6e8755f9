"""Anthropic-compatible route: POST /v1/messages (plain JSON and the event stream)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from freetoken.engine.request import RequestOutput, Usage
from freetoken.engine.stream import RequestStream
from freetoken.server.context import ServerContext, collect
from freetoken.server.metrics import RequestTimer
from freetoken.server.protocol import AnthropicText, MessagesRequest, parse_body
from freetoken.server.sse import new_id, sse_event, sse_response

router = APIRouter()


def block_text(content: str | list[AnthropicText] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(block.text for block in content)


def chat_messages(body: MessagesRequest) -> list[dict]:
    system = block_text(body.system)
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": m.role, "content": block_text(m.content)} for m in body.messages]


def stop_fields(output: RequestOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for the final output."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if isinstance(output.stop_reason, str):
        return "stop_sequence", output.stop_reason
    return "end_turn", None


@router.post("/v1/messages")
async def messages(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, MessagesRequest)
    ctx.check_model(body.model)
    params = body.sampling_params()
    prompt = ctx.chat_prompt_ids(chat_messages(body))
    timer = ctx.metrics.timer()
    stream = ctx.submit(prompt, params, timer)
    message_id = new_id("msg_")
    if body.stream:
        response = sse_response(message_events(stream, timer, message_id, ctx.model_name,
                                               len(prompt)))
        response.background = BackgroundTask(stream.abort)
        return response
    text, last, _ = await collect(request, stream, timer)
    stop_reason, stop_sequence = stop_fields(last)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": [{"type": "text", "text": text}], "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_dict(last.usage)})


def usage_dict(usage: Usage) -> dict:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens (their sum is
    the prompt); nothing is charged for writing the cache, so cache_creation_input_tokens is 0."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens,
            "output_tokens": usage.completion_tokens}


async def message_events(stream: RequestStream, timer: RequestTimer, message_id: str,
                         model: str, prompt_tokens: int) -> AsyncIterator[str]:
    """message_start, content_block_start, ping, content_block_delta..., content_block_stop,
    message_delta (stop_reason, output_tokens), message_stop. Leaving early aborts."""
    message = {"id": message_id, "type": "message", "role": "assistant", "content": [],
               "model": model, "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0, "output_tokens": 0}}
    try:
        yield sse_event("message_start", {"type": "message_start", "message": message})
        yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
        yield sse_event("ping", {"type": "ping"})
        async for output in stream:
            timer.on_output(output)
            if output.finish_reason in ("error", "abort"):
                detail = output.error or "the request was aborted"
                yield sse_event("error", {"type": "error", "error": {
                    "type": "api_error", "message": f"generation failed: {detail}"}})
                return
            if output.text:
                yield sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": output.text}})
            if output.finished:
                stop_reason, stop_sequence = stop_fields(output)
                yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
                yield sse_event("message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage_dict(output.usage)})  # cumulative, cache reads known now
                yield sse_event("message_stop", {"type": "message_stop"})
    finally:
        stream.abort()
