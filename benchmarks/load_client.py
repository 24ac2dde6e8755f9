"""The load generator's client: streamed OpenAI chat completions over httpx, timed chunk by
chunk, sent either open-loop (at scheduled arrival times, whatever the server's pace) or
closed-loop (a fixed number of streams, each sending its next request when one ends).

Every request asks for a fixed output length (`max_tokens` with `ignore_eos`, which FreeToken
and llama-server both take), so a model that would stop early still does the work asked.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from benchmarks.load_stats import RequestRecord
from benchmarks.load_workload import RequestSpec


@dataclass(frozen=True)
class ChatTarget:
    """Where and how to send: the server's base URL and the sampling every request uses."""

    base_url: str
    temperature: float = 0.0
    timeout_s: float = 600.0

    def body(self, spec: RequestSpec) -> dict:
        return {"messages": [{"role": "user", "content": spec.prompt}],
                "max_tokens": spec.output_tokens, "ignore_eos": True,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}


def _has_text(delta: dict) -> bool:
    # A reasoning model streams its thinking as reasoning_content: tokens all the same.
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def read_chunk(record: RequestRecord, payload: dict, now: float) -> bool:
    """Fold one SSE data payload into the record; True when it finished the choice."""
    if "error" in payload:
        error = payload["error"]
        record.error = "stream_error"
        record.detail = str(error.get("message") if isinstance(error, dict) else error)[:300]
        return True
    if payload.get("usage"):
        record.prompt_tokens = payload["usage"].get("prompt_tokens")
        record.completion_tokens = payload["usage"].get("completion_tokens")
    finished = False
    for choice in payload.get("choices") or []:
        if _has_text(choice.get("delta") or {}):
            record.chunk_times.append(now)
        finished = finished or choice.get("finish_reason") is not None
    return finished


async def _read_stream(response, record: RequestRecord) -> None:
    finished = done = False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue               # blank separators, `event:` and `:` comment lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        finished = read_chunk(record, json.loads(data), time.perf_counter()) or finished
        if record.error:
            return
    if not (done or finished):
        record.error, record.detail = "incomplete", "the stream ended without [DONE]"


async def send_chat(client, target: ChatTarget, spec: RequestSpec) -> RequestRecord:
    """One streamed request; never raises for what the server or the network does: the
    record's `error` names the kind (http_<status>, timeout, connect, disconnected,
    transport, bad_chunk, stream_error, incomplete)."""
    import httpx

    record = RequestRecord(index=spec.index, sent=time.perf_counter(),
                           asked_tokens=spec.output_tokens)
    try:
        async with client.stream("POST", target.base_url + "/v1/chat/completions",
                                 json=target.body(spec)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error, record.detail = f"http_{response.status_code}", text[:300]
            else:
                await _read_stream(response, record)
    except httpx.TimeoutException as exc:
        record.error, record.detail = "timeout", repr(exc)
    except httpx.ConnectError as exc:
        record.error, record.detail = "connect", repr(exc)
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        record.error, record.detail = "disconnected", repr(exc)
    except httpx.HTTPError as exc:
        record.error, record.detail = "transport", repr(exc)
    except json.JSONDecodeError as exc:
        record.error, record.detail = "bad_chunk", repr(exc)
    record.ended = time.perf_counter()
    return record


def _client(target: ChatTarget, connections: int):
    import httpx

    return httpx.AsyncClient(
        timeout=httpx.Timeout(target.timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def run_open_loop(target: ChatTarget, specs: list[RequestSpec], arrivals: list[float],
                        duration_s: float | None = None) -> list[RequestRecord]:
    """Send specs[i] at arrivals[i] seconds after the start, without waiting for replies
    (arrivals at or after `duration_s` are not sent); the records of all sent."""
    async with _client(target, len(specs)) as client:
        start, tasks = time.perf_counter(), []
        for spec, at in zip(specs, arrivals):
            if duration_s is not None and at >= duration_s:
                break
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_chat(client, target, spec)))
        return list(await asyncio.gather(*tasks))


async def run_closed_loop(target: ChatTarget, specs: list[RequestSpec], concurrency: int,
                          duration_s: float | None = None) -> list[RequestRecord]:
    """`concurrency` streams, each sending the next spec when its last request ends, until
    the specs run out or `duration_s` has passed (requests in flight then still finish)."""
    pending = iter(specs)
    records: list[RequestRecord] = []
    async with _client(target, concurrency) as client:
        start = time.perf_counter()

        async def stream() -> None:
            for spec in pending:     # one iterator shared by all streams: each spec once
                if duration_s is not None and time.perf_counter() - start >= duration_s:
                    return
                records.append(await send_chat(client, target, spec))

        await asyncio.gather(*(stream() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)
