"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.background import BackgroundTask

from freetoken.engine.request import RequestOutput, TokenLogprob, Usage
from freetoken.engine.stream import RequestStream
from freetoken.server.adapters import openai_agent_request
from freetoken.server.chat_output import ChatShaper
from freetoken.server.context import ServerContext, agent_errors, collect
from freetoken.server.errors import APIError
from freetoken.server.images import prepare_chat, refuse_placeholders
from freetoken.server.metrics import RequestTimer
from freetoken.server.protocol import (ChatCompletionRequest, CompletionRequest, OpenAISampling,
                                       parse_body)
from freetoken.server.sse import new_id, sse_data, sse_response

router = APIRouter()


def usage_dict(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    return {"object": "list", "data": [model_card(ctx)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    ctx: ServerContext = request.app.state.ctx
    ctx.check_model(model_id)
    return model_card(ctx)


def model_card(ctx: ServerContext) -> dict:
    return {"id": ctx.model_name, "object": "model", "created": ctx.created,
            "owned_by": "freetoken", "max_model_len": ctx.engine.max_request_tokens}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(body.model)
    body.check_supported()
    max_tokens = ctx.output_limit(body.max_completion_tokens or body.max_tokens,
                                  "max_completion_tokens" if body.max_completion_tokens
                                  else "max_tokens")
    params = body.sampling_params(max_tokens)
    with agent_errors():
        agent_request = openai_agent_request(body)
    prepared, images = await prepare_chat(ctx, agent_request, max_tokens)
    return await respond(request, ctx, body, prepared.prompt_ids, params, new_id("chatcmpl-"),
                         chat=True, shaper=ChatShaper(prepared.parser), guide=prepared.guide,
                         images=images)


@router.post("/v1/completions")
async def completions(request: Request):
    ctx: ServerContext = request.app.state.ctx
    body = await parse_body(request, CompletionRequest)
    ctx.check_model(body.model)
    body.check_supported()
    params = body.sampling_params(ctx.output_limit(body.max_tokens, "max_tokens"))
    prompt = completion_prompt_ids(ctx, body.prompt)
    refuse_placeholders(ctx, prompt, "prompt")
    return await respond(request, ctx, body, prompt, params, new_id("cmpl-"), chat=False)


def completion_prompt_ids(ctx: ServerContext, prompt) -> list[int]:
    if isinstance(prompt, str):
        return ctx.text_prompt_ids(prompt)
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if len(prompt) != 1:
        raise APIError(400, f"got {len(prompt)} prompts: this server takes one prompt per "
                            "request", "prompt")
    only = prompt[0]
    return ctx.text_prompt_ids(only) if isinstance(only, str) else list(only)


async def respond(request: Request, ctx: ServerContext, body: OpenAISampling, prompt: list[int],
                  params, request_id: str, chat: bool, shaper: ChatShaper | None = None,
                  guide=None, images: tuple = ()):
    timer = ctx.metrics.timer()
    stream = ctx.submit(prompt, params, timer, guide, images)
    shaper = shaper or ChatShaper(None)
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    format_logprobs = LogprobFormat(ctx, chat, params.logprobs is not None)
    if body.stream:
        make_chunk = chat_chunk if chat else completion_chunk
        header = dict(id=request_id, object=kind + (".chunk" if chat else ""), created=created,
                      model=ctx.model_name)
        events = stream_events(stream, timer, header, make_chunk, chat, body.include_usage,
                               format_logprobs, shaper)
        response = sse_response(events)
        response.background = BackgroundTask(stream.abort)  # also when the body never started
        return response
    text, last, entries = await collect(request, stream, timer)
    choice = ({"index": 0, "message": shaper.message(text)} if chat
              else {"index": 0, "text": text})
    choice.update(logprobs=format_logprobs(entries),
                  finish_reason=shaper.finish_reason(last.finish_reason))
    return JSONResponse({"id": request_id, "object": kind, "created": created,
                         "model": ctx.model_name, "choices": [choice],
                         "usage": usage_dict(last.usage)})


class LogprobFormat:
    """Token logprob entries as OpenAI spells them: chat `{"content": [...]}`, completions
    `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; None when not asked for."""

    def __init__(self, ctx: ServerContext, chat: bool, wanted: bool):
        self.ctx, self.chat, self.wanted = ctx, chat, wanted
        self.offset = 0     # completions: where the next token starts in the generated text

    def __call__(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.wanted:
            return None
        text = self.ctx.token_text
        if self.chat:
            return {"content": [{**self._token(e.token_id, e.logprob),
                                 "top_logprobs": [self._token(i, lp) for i, lp in e.top]}
                                for e in entries]}
        tokens = [text(e.token_id) for e in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(i): lp for i, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _token(self, token_id: int, logprob: float) -> dict:
        token = self.ctx.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_chunk(delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(delta: dict, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"index": 0, "text": delta.get("content", ""), "logprobs": logprobs,
            "finish_reason": finish_reason}


def stream_error(output: RequestOutput) -> dict:
    """The error event that ends a stream the engine failed ("error") or the server ended
    ("abort": shutting down), in OpenAI's error shape."""
    failed = output.finish_reason == "error"
    message = (f"generation failed: {output.error}" if failed
               else f"the request was aborted: {output.error or 'the server is stopping'}")
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": None}}


async def stream_events(stream: RequestStream, timer: RequestTimer, header: dict,
                        make_chunk: Callable[..., dict], chat: bool, include_usage: bool,
                        format_logprobs: LogprobFormat,
                        shaper: ChatShaper) -> AsyncIterator[str]:
    """OpenAI SSE: a role chunk (chat), content chunks (with their tokens' logprobs when asked
    for), a finish_reason chunk, an optional usage chunk with no choices, then [DONE]; a
    request the engine failed or the server ended sends an error event before [DONE]. Leaving
    early aborts the request."""
    extra = {"usage": None} if include_usage else {}

    def event(delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> str:
        return sse_data({**header, "choices": [make_chunk(delta, finish_reason, logprobs)],
                         **extra})

    try:
        if chat:
            yield event({"role": "assistant", "content": ""})
        async for output in stream:
            timer.on_output(output)
            if output.finish_reason in ("error", "abort"):   # the client did not abort it
                yield sse_data(stream_error(output))
                break
            logprobs = format_logprobs(output.logprobs or []) if output.logprobs else None
            deltas = shaper.deltas(output.text, output.finished)
            if logprobs is not None and not deltas:
                deltas = [{"content": ""}]
            for i, delta in enumerate(deltas):
                yield event(delta, logprobs=logprobs if i == 0 else None)
            if output.finished:
                yield event({}, shaper.finish_reason(output.finish_reason))
                if include_usage:
                    yield sse_data({**header, "choices": [], "usage": usage_dict(output.usage)})
        yield sse_data("[DONE]")
    finally:
        stream.abort()
