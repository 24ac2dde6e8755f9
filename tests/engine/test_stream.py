"""Outputs crossing from the engine thread to the event loop: in order per request, and one
loop wake-up per engine step inside batched_delivery()."""

from __future__ import annotations

import asyncio
import threading

from freetoken.engine.request import RequestOutput, Usage
from freetoken.engine.stream import RequestStream, batched_delivery


def _out(rid: str, token: int, last: bool = False) -> RequestOutput:
    return RequestOutput(rid, [token], str(token), "length" if last else None, Usage(1, token))


async def _collect(stream: RequestStream) -> list[int]:
    return [t for out in [o async for o in stream] for t in out.token_ids]


def _wake_counter(loop: asyncio.AbstractEventLoop) -> list[int]:
    calls, original = [0], loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)
    loop.call_soon_threadsafe = counting
    return calls


def test_one_wake_up_per_step_and_order_kept():
    async def main():
        loop = asyncio.get_running_loop()
        wakes = _wake_counter(loop)
        streams = [RequestStream(f"r{i}", loop, lambda rid: True) for i in range(3)]
        early = []

        def engine_thread():
            for step in range(5):
                with batched_delivery():
                    before = wakes[0]
                    for s in streams:
                        s.put(_out(s.request_id, step, last=step == 4))
                    early.append(wakes[0] != before)  # nothing is sent before the step ends

        thread = threading.Thread(target=engine_thread)
        thread.start()
        results = await asyncio.gather(*(_collect(s) for s in streams))
        thread.join()
        assert results == [[0, 1, 2, 3, 4]] * 3
        assert early == [False] * 5
        assert 1 <= wakes[0] <= 5  # 15 outputs, at most one wake-up per step
    asyncio.run(main())


def test_outside_a_step_each_output_is_delivered_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        stream = RequestStream("r", loop, lambda rid: True)
        thread = threading.Thread(target=lambda: [stream.put(_out("r", t, t == 2))
                                                  for t in range(3)])
        thread.start()
        assert await _collect(stream) == [0, 1, 2]
        thread.join()
    asyncio.run(main())
