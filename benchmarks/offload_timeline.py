"""Where an offloaded decode step's time goes: a window of decode steps of a running engine
under torch.profiler (CUDA activity: kernels and copies) with the expert cache's host calls
timed, summed per step as

    wall       the host's time per step (the window's wall time / steps)
    kernels    time some kernel ran (union of kernel intervals)
    h2d        time some host-to-device copy ran (union), and the bytes it moved / that time
    both       kernels and copies at once (kernels + h2d - their union)
    idle       neither: the GPU waited for the host (wall - union)
    host       per step: the cache's MoE-layer calls (prepare_segment between graph segments,
               run in eager steps), split into the rest (waiting for the routed ids; eagerly
               also the layer's kernel launches), the look-ups and copy launches of the
               routed layer and of the next layer's prefetch (the copy launches alone also
               given), and the experts co-executed on the CPU (--moe-cpu auto)

so a run far from its copy ceiling says whether the copies, the kernels or the host's serial
chain between them is what is left. Used by gpu_full_depth.py --profile.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


def interval_union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (any order, overlaps counted once)."""
    total, reach = 0.0, None
    for start, end in sorted(spans):
        if end <= start:
            continue
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


@dataclass(frozen=True)
class Timeline:
    """Per-step figures of a profiled window (milliseconds, bytes)."""

    steps: int
    wall_ms: float
    kernels_ms: float
    h2d_ms: float
    union_ms: float
    h2d_bytes: float
    host_segment_ms: float
    host_wait_ms: float
    host_route_ms: float
    host_copy_ms: float
    copies: float
    host_cpu_ms: float = 0.0

    @property
    def both_ms(self) -> float:
        return self.kernels_ms + self.h2d_ms - self.union_ms

    @property
    def idle_ms(self) -> float:
        return max(0.0, self.wall_ms - self.union_ms)

    @property
    def h2d_GBps(self) -> float:
        return self.h2d_bytes / (self.h2d_ms * 1e6) if self.h2d_ms else 0.0

    def describe(self) -> str:
        return (f"per step: wall {self.wall_ms:.2f} ms = kernels {self.kernels_ms:.2f} + "
                f"copies {self.h2d_ms:.2f} ({self.h2d_GBps:.1f} GB/s while copying) - both at "
                f"once {self.both_ms:.2f} + GPU idle {self.idle_ms:.2f}; host: MoE calls "
                f"{self.host_segment_ms:.2f} ms (waiting for ids etc. {self.host_wait_ms:.2f}, "
                f"look-ups and launches {self.host_route_ms:.2f}, of which {self.copies:.0f} "
                f"copy launches {self.host_copy_ms:.2f}; CPU experts {self.host_cpu_ms:.2f})")


def summarize(events: list[tuple[str, float, float]], wall_s: float, steps: int,
              h2d_bytes: float, host: dict[str, float]) -> Timeline:
    """events: (kind, start us, end us) with kind "kernel", "h2d" or anything else (D2H,
    memsets: ignored); host: seconds summed over the window ("segment", "wait", "route",
    "copy", "cpu": co-executed experts) and "copies" (a count)."""
    kernels = [(s, e) for kind, s, e in events if kind == "kernel"]
    h2d = [(s, e) for kind, s, e in events if kind == "h2d"]
    both = [(s, e) for kind, s, e in events if kind in ("kernel", "h2d")]
    per = 1.0 / max(steps, 1)
    return Timeline(steps=steps, wall_ms=1e3 * wall_s * per,
                    kernels_ms=interval_union(kernels) / 1e3 * per,
                    h2d_ms=interval_union(h2d) / 1e3 * per,
                    union_ms=interval_union(both) / 1e3 * per, h2d_bytes=h2d_bytes * per,
                    host_segment_ms=1e3 * host.get("segment", 0.0) * per,
                    host_wait_ms=1e3 * host.get("wait", 0.0) * per,
                    host_route_ms=1e3 * host.get("route", 0.0) * per,
                    host_copy_ms=1e3 * host.get("copy", 0.0) * per,
                    copies=host.get("copies", 0.0) * per,
                    host_cpu_ms=1e3 * host.get("cpu", 0.0) * per)


def event_kind(name: str) -> str:
    if "Memcpy HtoD" in name:
        return "h2d"
    if "Memcpy" in name or "Memset" in name:
        return "other"
    return "kernel"


class _HostTimers:
    """Times the expert cache's host calls while `on`: prepare_segment and run (a graph
    replay calls only the first, an eager step only the second), _route and _prefetch, the
    copy launches (their count too) and the pool's co-executed experts on the CPU."""

    def __init__(self, cache):
        self.cache, self.on = cache, False
        self.totals = {"segment": 0.0, "route": 0.0, "prefetch": 0.0, "copy": 0.0,
                       "copies": 0.0, "cpu": 0.0}
        self._saved = []
        for name, key in (("prepare_segment", "segment"), ("run", "segment"),
                          ("_route", "route"), ("_prefetch", "prefetch"),
                          ("_copy_expert", "copy")):
            self._wrap(cache, name, key)
        pool = getattr(cache, "pool", None)
        if pool is not None and hasattr(pool, "cpu_experts"):
            self._wrap(pool, "cpu_experts", "cpu")

    def _wrap(self, owner, name: str, key: str) -> None:
        inner = getattr(owner, name)
        self._saved.append((owner, name))

        def timed(*args, **kwargs):
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start
                if key == "copy":
                    self.totals["copies"] += 1
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name in self._saved:
            delattr(owner, name)           # the instance attribute: the class's method again

    def host(self) -> dict[str, float]:
        t = dict(self.totals)
        # the look-ups and launches: the routed layer's and the next layer's prefetch
        t["route"] += t.pop("prefetch")
        t["wait"] = max(0.0, t["segment"] - t["route"] - t["cpu"])
        return t


def _generated(engine) -> int:
    """The engine's running count of generated tokens (a dict read: cheap to poll)."""
    return engine._counters["tokens_generated"]


def profile_decode(engine, batch: int, vocab: int, skip: int = 8, steps: int = 32,
                   tail: int = 8) -> Timeline:
    """Decode `batch` requests; profile from the engine's step `skip` of them (every request
    decoding by then) to step skip + steps, by its generated tokens (a thread polls them: the
    requests' outputs may reach the caller several tokens at a time), and return the window's
    Timeline. The requests run `tail` steps past the window (they decode until it closes)."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    from freetoken.engine.request import SamplingParams

    cache = engine.expert_cache
    timers = _HostTimers(cache) if cache is not None else None
    prof = profile(activities=[ProfilerActivity.CUDA])
    mark: dict[str, float] = {}
    base = _generated(engine)

    def wait_for(tokens: int) -> bool:
        """Until the engine generated `tokens` more (True), or the requests ended (False)."""
        while _generated(engine) < base + tokens:
            if "done" in mark:
                return False
            time.sleep(0.0005)
        return True

    def watch() -> None:
        if not wait_for(batch * skip):
            return
        torch.cuda.synchronize()
        mark["bytes"] = cache.stats.bytes_h2d if cache is not None else 0
        mark["tokens"] = _generated(engine)
        prof.start()
        if timers:
            timers.on = True
        mark["t0"] = time.perf_counter()
        closed = wait_for(batch * (skip + steps))
        mark["t1" if closed else "short"] = time.perf_counter()
        mark["steps"] = (_generated(engine) - mark["tokens"]) / batch
        if timers:
            timers.on = False
        torch.cuda.synchronize()
        prof.stop()
        mark["bytes"] = (cache.stats.bytes_h2d if cache is not None else 0) - mark["bytes"]

    async def one(prompt: list[int]) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max(1, skip + steps + tail),
                                ignore_eos=True)
        async for _ in engine.generate(prompt, params):
            pass

    async def run_all() -> None:
        await asyncio.gather(*(one(p) for p in prompts))

    prompts = [[(7 + 13 * i + j) % vocab for j in range(64)] for i in range(batch)]
    watcher = threading.Thread(target=watch, name="offload-timeline", daemon=True)
    watcher.start()
    try:
        asyncio.run(run_all())
    finally:
        mark["done"] = 1.0
        watcher.join()
        if timers:
            timers.restore()
    if "t1" not in mark:
        raise RuntimeError(f"the window of {steps} steps after {skip} did not close before the "
                           f"requests ended")
    events = [(event_kind(e.name), e.time_range.start, e.time_range.end)
              for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA]
    return summarize(events, mark["t1"] - mark["t0"], max(1, round(mark["steps"])),
                     mark["bytes"], timers.host() if timers else {})
