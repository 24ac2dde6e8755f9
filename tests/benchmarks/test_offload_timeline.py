"""benchmarks/offload_timeline.py on the CPU: the interval arithmetic a profiled window is
summed with, and the host timers it wraps around an expert cache."""

from __future__ import annotations

import time

import pytest

from benchmarks.offload_timeline import (Timeline, _HostTimers, event_kind, interval_union,
                                         summarize)


@pytest.mark.parametrize("spans,covered", [
    ([], 0.0),
    ([(0, 10)], 10.0),
    ([(0, 10), (20, 25)], 15.0),                 # disjoint
    ([(0, 10), (5, 15)], 15.0),                  # overlapping
    ([(0, 30), (5, 10), (12, 20)], 30.0),        # nested
    ([(20, 25), (0, 10), (8, 21)], 25.0),        # out of order, chained
    ([(5, 5), (7, 6)], 0.0),                     # empty and reversed intervals
])
def test_interval_union_counts_covered_time_once(spans, covered):
    assert interval_union(spans) == pytest.approx(covered)


def test_event_kinds_follow_the_profilers_names():
    assert event_kind("Memcpy HtoD (Pinned -> Device)") == "h2d"
    assert event_kind("Memcpy DtoH (Device -> Pinned)") == "other"
    assert event_kind("Memset (Device)") == "other"
    assert event_kind("void freetoken::moe_q8_down_kernel<4>(...)") == "kernel"


def test_a_window_is_split_into_kernels_copies_overlap_and_idle():
    # two steps over 1 ms of wall time (microsecond events): kernels 0-200 and 500-700, a copy
    # 100-400 (overlapping the first kernel by 100 us), a D2H copy that only joins nothing
    events = [("kernel", 0, 200), ("h2d", 100, 400), ("kernel", 500, 700),
              ("other", 800, 900)]
    host = {"segment": 4e-4, "route": 1e-4, "copy": 6e-5, "copies": 6, "wait": 3e-4}
    t = summarize(events, wall_s=1e-3, steps=2, h2d_bytes=2e6, host=host)
    assert t.kernels_ms == pytest.approx(0.2)         # 400 us over 2 steps
    assert t.h2d_ms == pytest.approx(0.15)
    assert t.union_ms == pytest.approx(0.3)           # 0-400 and 500-700
    assert t.both_ms == pytest.approx(0.05)           # 100-200
    assert t.idle_ms == pytest.approx(0.2)            # 0.5 ms a step less 0.3 busy
    assert t.h2d_GBps == pytest.approx(1e6 / 0.15e6)  # 1 MB a step in 0.15 ms
    assert (t.host_segment_ms, t.host_route_ms, t.copies) == pytest.approx((0.2, 0.05, 3))
    assert "GPU idle 0.20" in t.describe()


def test_no_copies_read_as_zero_bandwidth():
    t = Timeline(steps=1, wall_ms=1, kernels_ms=1, h2d_ms=0, union_ms=1, h2d_bytes=0,
                 host_segment_ms=0, host_wait_ms=0, host_route_ms=0, host_copy_ms=0, copies=0)
    assert t.h2d_GBps == 0 and t.idle_ms == 0 and t.both_ms == 0


class StandInPool:
    def __init__(self, calls):
        self.calls = calls

    def cpu_experts(self, layer):
        self.calls.append(("cpu", layer))


class StandInCache:
    def __init__(self):
        self.calls = []
        self.pool = StandInPool(self.calls)

    def prepare_segment(self, layer, ids):
        self.calls.append(("prepare", layer))
        self._route(layer, ids)
        self.pool.cpu_experts(layer)

    def _route(self, layer, ids):
        self.calls.append(("route", layer))
        for slot in range(ids):
            self._copy_expert(layer, slot, slot)

    def _copy_expert(self, layer, expert, slot):
        self.calls.append(("copy", expert))

    def run(self, layer, ids):           # an eager step's call: looks up, then prefetches
        self._route(layer, ids)
        self._prefetch(layer + 1, 1)

    def _prefetch(self, layer, ids):
        self.calls.append(("prefetch", layer))
        self._copy_expert(layer, 9, 9)


def test_host_timers_count_only_while_on_and_restore_the_cache():
    cache = StandInCache()
    timers = _HostTimers(cache)
    cache.prepare_segment(0, 2)                       # off: not counted
    assert timers.totals["copies"] == 0
    timers.on = True
    cache.prepare_segment(1, 3)
    timers.on = False
    host = timers.host()
    assert host["copies"] == 3 and host["segment"] >= host["route"] >= host["copy"] > 0
    assert host["cpu"] > 0
    assert host["wait"] == pytest.approx(host["segment"] - host["route"] - host["cpu"])
    timers.on = True
    cache.run(2, 1)                                   # eager: run, its look-ups, a prefetch
    timers.on = False
    eager = timers.host()
    assert eager["copies"] == 5 and eager["route"] > host["route"]
    assert eager["segment"] >= eager["route"] and "prefetch" not in eager
    timers.restore()
    assert not set(vars(cache)) & {"prepare_segment", "run", "_route", "_prefetch",
                                   "_copy_expert"}
    assert "cpu_experts" not in vars(cache.pool)
    assert cache.calls[-1] == ("copy", 9)             # every call still ran through


class StubProfile:
    """torch.profiler.profile without a GPU: records when the window opens and closes."""

    def __init__(self, activities=None):
        self.calls = []

    def start(self):
        self.calls.append("start")

    def stop(self):
        self.calls.append("stop")

    def events(self):
        return []


def test_profile_decode_opens_its_window_mid_decode_and_counts_its_steps(monkeypatch):
    """The window opens at the first request's token `skip` and closes `steps` tokens later,
    every request decoding; its step count is the engine's generated tokens over the batch."""
    import torch
    import torch.profiler

    from benchmarks import offload_timeline
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from tests.engine.fakes import CharTokenizer, FakeModel

    made = []
    monkeypatch.setattr(torch.profiler, "profile",
                        lambda activities=None: made.append(StubProfile()) or made[-1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    engine = Engine(FakeModel(), CharTokenizer(), EngineConfig(
        num_tokens=2048, block_size=8, max_num_seqs=4, max_prefill_tokens=512,
        device="cpu"))
    step = engine._step

    def slow_step(*work):     # a GPU-like step time, so the window is many polls long
        time.sleep(0.005)
        step(*work)

    engine._step = slow_step
    engine.start()
    try:
        timeline = offload_timeline.profile_decode(engine, batch=3, vocab=60, skip=4, steps=12)
        # a window longer than the requests: refused by name
        with pytest.raises(RuntimeError, match="did not close"):
            offload_timeline.profile_decode(engine, batch=2, vocab=60, skip=4, steps=12,
                                            tail=-14)
    finally:
        engine.shutdown()
    assert made[0].calls == ["start", "stop"]
    # the watcher polls every 0.5 ms against 5 ms steps: the window spans the steps asked for
    assert 11 <= timeline.steps <= 13, timeline
    assert timeline.kernels_ms == timeline.h2d_ms == 0
    assert timeline.wall_ms >= 4.0       # every step sleeps 5 ms (11+ of them in 13 counted)
