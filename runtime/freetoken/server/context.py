"""What every route needs: the engine, the tokenizer, the served name, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from freetoken.engine.admission import AdmissionRefused
from freetoken.engine.engine import Engine, EngineDead
from freetoken.engine.request import (PromptTooLong, RequestOutput, RequestRejected,
                                      SamplingParams)
from freetoken.engine.stream import RequestStream
from freetoken.server.errors import APIError
from freetoken.server.metrics import Metrics, RequestTimer


@dataclass
class ServerContext:
    engine: Engine
    tokenizer: Any
    model_name: str
    metrics: Metrics
    api_key: str | None = None
    max_output_tokens: int | None = None    # default and cap of a request's max_tokens
    allow_image_urls: bool = False          # fetch http(s) image URLs (else a 400)
    max_image_pixels: int | None = None     # resized image area cap (None: the model's)
    created: int = field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def agent(self):
        """Tool calls, thinking and constrained decoding for the served model."""
        from freetoken.server.agent import AgentSupport

        return AgentSupport(self.tokenizer, self.engine.model.config.vocab_size)

    def output_limit(self, requested: int | None, param: str) -> int | None:
        """max_tokens to use: the request's, capped by --max-output-tokens (its default when
        unset); more than one request may hold is a 400 naming `param`."""
        limit = self.engine.max_request_tokens
        if requested is not None and requested >= limit:
            raise APIError(400, f"{param}={requested} is more than this server's context "
                                f"allows ({limit} tokens per request, prompt included)", param)
        if self.max_output_tokens is None:
            return requested
        return min(requested or self.max_output_tokens, self.max_output_tokens)

    def check_model(self, requested: str | None) -> None:
        """None means the served model; any other name is a 404."""
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"The model '{requested}' does not exist; this server serves "
                                f"'{self.model_name}'", "model", "model_not_found")

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def text_prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               timer: RequestTimer, guide=None, images: tuple = ()) -> RequestStream:
        """Queue the request; `images` (ImageInput, in prompt order) only reach an engine
        with a vision tower, so a text-only engine keeps its text-only submit."""
        extra = {"images": images} if images else {}
        try:
            stream = self.engine.submit(prompt_ids, params, guide=guide, **extra)
        except RequestRejected as exc:
            code = "context_length_exceeded" if isinstance(exc, PromptTooLong) else None
            raise APIError(400, str(exc), None, code) from None
        except AdmissionRefused as exc:   # 503 (Anthropic: 529) that says when to retry
            retry = {"Retry-After": str(exc.retry_after_s)}
            raise APIError(503, str(exc), headers=retry) from None
        except EngineDead as exc:
            raise APIError(503, str(exc)) from None
        timer.prompt_tokens = len(prompt_ids)
        return stream


@contextlib.contextmanager
def agent_errors():
    """AgentRequestError (bad tools, schemas, tool history) as a 400 naming the field."""
    from freetoken.agent.request import AgentRequestError

    try:
        yield
    except AgentRequestError as exc:
        raise APIError(400, str(exc), exc.param) from None


async def collect(request: Request, stream: RequestStream,
                  timer: RequestTimer) -> tuple[str, RequestOutput, list]:
    """All text of a non-streamed request, its last output and every token's logprob entry
    (empty unless asked for); a client that goes away aborts the request so its KV pages are
    freed."""
    async def gather() -> tuple[str, RequestOutput, list]:
        pieces, entries = [], []
        async for output in stream:
            timer.on_output(output)
            pieces.append(output.text)
            entries.extend(output.logprobs or ())
        return "".join(pieces), output, entries

    task = asyncio.ensure_future(gather())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.abort()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")
    text, last, entries = task.result()
    if last.finish_reason == "error":
        raise APIError(500, f"generation failed: {last.error}")
    if last.finish_reason == "abort":
        raise APIError(503, f"the request was aborted: {last.error or 'the server is stopping'}")
    return text, last, entries


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
