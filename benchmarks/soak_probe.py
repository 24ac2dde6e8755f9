"""What benchmarks/serve_soak.py reads from the server it soaks: its counters (/v1/stats and
/metrics), its RSS (/proc/PID/status of the pid /health names) and allocated VRAM (/v1/stats)
over time, and whether it is idle; and the KV fill that precedes a CPU run. A server that
stops answering yields None, never an exception: the checks then say so."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from benchmarks.soak_checks import ServerCounts
from benchmarks.soak_requests import WORDS

SAMPLED = ("running", "waiting", "kv_pages_used", "prefix_cache_evictions", "requests_finished")
HELD = ("running", "waiting", "kv_pages_used", "state_slots_used")


def read_rss(pid: int | None) -> int | None:
    """The process's resident set in bytes (None when it cannot be read here)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, TypeError):
        return None
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


class Probe:
    """One server, through the run's HTTP client."""

    def __init__(self, client, url: str):
        self.client, self.url, self.pid = client, url, None

    async def start(self) -> dict:
        """/health's answer; remembers the server's pid for read_rss."""
        health = (await self.client.get(self.url + "/health")).json()
        self.pid = health.get("pid")
        return health

    async def stats(self) -> dict | None:
        import httpx

        try:
            return (await self.client.get(self.url + "/v1/stats")).json()
        except httpx.HTTPError:
            return None

    async def counts(self) -> ServerCounts | None:
        import httpx

        stats = await self.stats()
        try:
            metrics = (await self.client.get(self.url + "/metrics")).text
        except httpx.HTTPError:
            return None
        return None if stats is None else ServerCounts.read(stats, metrics)

    async def sample(self, start: float) -> dict:
        stats = await self.stats() or {}
        return {"t": round(time.perf_counter() - start, 2), "rss": read_rss(self.pid),
                "vram": stats.get("vram_allocated_bytes") or None,
                **{k: stats.get(k) for k in SAMPLED}}

    async def watch(self, start: float, interval: float, samples: list,
                    stop: asyncio.Event) -> None:
        """Append a sample every `interval` seconds until `stop` is set."""
        while not stop.is_set():
            samples.append(await self.sample(start))
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def wait_idle(self, timeout: float) -> dict | None:
        """/v1/stats once nothing is held, or as it is after `timeout` seconds."""
        end = time.monotonic() + timeout
        while True:
            stats = await self.stats()
            if stats is None or not any(stats.get(k, 0) for k in HELD) \
                    or time.monotonic() > end:
                return stats
            await asyncio.sleep(0.2)

    async def fill_kv_pool(self, rng: random.Random) -> int:
        """On the CPU with the prefix cache on, prefill distinct prompts until the cache
        evicts a page: every KV page has then been written once. The CPU pool is mapped on
        first write and the prefix cache hands out never-used pages before it evicts, so
        without this RSS would grow through a long run by up to the pool's size with no leak.
        Returns the requests it sent (before the run's counters are read: not in the tally)."""
        stats = await self.stats() or {}
        if stats.get("device") != "cpu" or not stats.get("prefix_cache"):
            return 0
        words = max(16, min(512, stats["max_request_tokens"] // 4))
        sent = 0
        while sent < 4 + stats["kv_pages_total"] * stats["kv_block_size"] // words:
            body = {"prompt": " ".join(rng.choices(WORDS, k=words)), "max_tokens": 1,
                    "temperature": 0}
            (await self.client.post(self.url + "/v1/completions", json=body)).raise_for_status()
            sent += 1
            now = await self.stats() or {}
            if now.get("prefix_cache_evictions", 0) > stats["prefix_cache_evictions"]:
                break
        return sent
