"""Graceful shutdown: stop admission first, let the requests inside the engine finish for a
grace period, then end the rest, so every stream still sends its last event (its finish
reason, or an error event saying the server is shutting down) before its connection closes."""

from __future__ import annotations

import asyncio
import time
from typing import Any

POLL_S = 0.05
SHUTDOWN_REASON = "the server is shutting down"


def begin_shutdown(engine: Any, timeout_s: float) -> asyncio.Task:
    """Stop `engine` admitting requests now (they get 503/529 with Retry-After); the task
    returned ends whatever is still inside `timeout_s` seconds later. Call on the server's
    event loop."""
    engine.stop_admission()
    return asyncio.ensure_future(end_after(engine, timeout_s))


async def end_after(engine: Any, timeout_s: float) -> None:
    """Wait until the engine holds no request or `timeout_s` passed, then abort what is left
    (each stream then sends an error event and closes)."""
    deadline = time.monotonic() + timeout_s
    while engine.num_in_engine and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    if engine.num_in_engine:
        engine.abort_all(SHUTDOWN_REASON)
