"""The asyncio side of one request: outputs cross from the engine thread through the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from typing import Callable

from freetoken.engine.request import RequestOutput


class _Mailbox:
    """Outputs on their way to one event loop. Each call_soon_threadsafe writes to the loop's
    wake-up socket and hands the GIL to the loop thread (~100 us per call on two busy cores),
    so the outputs of one engine step (one per sequence) cross in a single call: inside
    ``batched_delivery()`` posts only queue up, and leaving it wakes each loop once. Per-queue
    order is kept (one FIFO, drained in order on the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
        held = getattr(_HOLD, "boxes", None)
        if held is not None:
            held[self] = None
        else:
            self.wake()

    def wake(self) -> None:
        """Schedule the delivery of what is pending, unless one is scheduled already."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the loop is closed: nobody is listening any more

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, output in pending:
            queue.put_nowait(output)


_HOLD = threading.local()


@contextlib.contextmanager
def batched_delivery():
    """On the engine thread, around one step's outputs: each loop is woken once, at the end."""
    _HOLD.boxes = boxes = {}
    try:
        yield
    finally:
        _HOLD.boxes = None
        for box in boxes:
            box.wake()


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def _mailbox(loop: asyncio.AbstractEventLoop) -> _Mailbox:
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = _Mailbox(loop)
        return box


class RequestStream:
    """Async iterator over one request's outputs; the last one has finish_reason set.

    Created by Engine.submit inside a running event loop. `abort()` (or leaving the loop early
    and calling it from a `finally`) stops the request and frees its KV pages.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 abort: Callable[[str], bool]):
        self.request_id = request_id
        self._mailbox = _mailbox(loop)
        self._abort = abort
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Called from the engine thread."""
        self._mailbox.post(self._queue, output)

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
