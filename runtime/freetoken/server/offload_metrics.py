"""Memory pools and expert-offload totals as Prometheus families, read from engine.stats() at
scrape time (the engine keeps the running totals)."""

from __future__ import annotations

from typing import Any, Callable

GAUGES = (
    ("freetoken_kv_pool_tokens", "kv_pool_tokens", "KV pool size in tokens"),
    ("freetoken_kv_pool_bytes", "kv_pool_bytes", "Bytes of the KV pool"),
    ("freetoken_expert_cache_rate", "moe_cache_rate",
     "Fraction of all routed experts held on the GPU (1: every expert resident)"),
    ("freetoken_expert_cache_slots", "expert_cache_slots", "Expert slots on the GPU"),
    ("freetoken_expert_pool_bytes", "expert_pool_bytes",
     "GPU bytes of the expert slots (with the two staging buffers when offloaded)"),
    ("freetoken_pinned_host_bytes", "pinned_bytes", "Pinned host bytes holding the experts"),
    ("freetoken_vram_allocated_bytes", "vram_allocated_bytes",
     "GPU bytes allocated by this process (torch allocator)"),
    ("freetoken_expert_bytes_per_token", "expert_bytes_per_token",
     "Expert bytes copied host-to-device per token processed"),
)
COUNTERS = (
    ("freetoken_expert_hits", "expert_hits", "Routed experts found in the GPU cache (decode)"),
    ("freetoken_expert_misses", "expert_misses", "Routed experts not in the GPU cache (decode)"),
    ("freetoken_expert_cpu_executed", "expert_cpu_executed",
     "Missed experts computed on the CPU instead of copied"),
    ("freetoken_expert_bytes_h2d", "expert_bytes_h2d",
     "Expert bytes copied host-to-device (cache fills and staged prefill layers)"),
    ("freetoken_expert_prefetched", "expert_prefetched",
     "Experts copied ahead of their layer, as the next layer's router predicted them"),
    ("freetoken_expert_prefetch_hits", "expert_prefetch_hits",
     "Prefetched experts that their layer then routed to"),
)


class StatsCollector:
    """Gauges and counters read from engine.stats() keys at scrape time: (metric name, stats
    key, help) rows in `gauges` and `counters` (a missing key reads as 0)."""

    gauges: tuple = ()
    counters: tuple = ()

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        self._engine_stats = engine_stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._engine_stats()
        for name, key, doc in self.gauges:
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key) or 0))
        for name, key, doc in self.counters:
            yield CounterMetricFamily(name, doc, value=float(stats.get(key) or 0))

    def describe(self):
        return []  # NOTE: no describe-time scrape; families are produced in collect()


class OffloadCollector(StatsCollector):
    gauges, counters = GAUGES, COUNTERS
