"""The asyncio side of one request: outputs cross from the engine thread through the loop."""

from __future__ import annotations

import asyncio
from typing import Callable

from freetoken.engine.request import RequestOutput


class RequestStream:
    """Async iterator over one request's outputs; the last one has finish_reason set.

    Created by Engine.submit inside a running event loop. `abort()` (or leaving the loop early
    and calling it from a `finally`) stops the request and frees its KV pages.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str], bool]):
        self.request_id = request_id
        self._loop = loop
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, output)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = await self._queue.get()
        if output.finished:
            self.finished = True
        return output

    def abort(self) -> None:
        """Stop the request unless it already ended; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)
