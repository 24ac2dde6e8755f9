"""Tensor parallelism on /metrics: the rank count and each rank's memory, read from
engine.stats() at scrape time."""

from __future__ import annotations

from typing import Any, Callable

RANK_GAUGES = (
    ("freetoken_rank_weight_bytes", "weight_bytes", "Bytes of the weights a rank holds"),
    ("freetoken_rank_kv_pool_bytes", "kv_pool_bytes", "Bytes of a rank's KV pool"),
)


class ParallelCollector:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        self._engine_stats = engine_stats

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self._engine_stats()
        yield GaugeMetricFamily("freetoken_tensor_parallel_size",
                                "Ranks the model is split over (1: not split)",
                                value=float(stats.get("tensor_parallel_size", 1)))
        for name, key, doc in RANK_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["rank", "device"])
            for rank in stats.get("ranks", ()):
                family.add_metric([str(rank["rank"]), rank["device"]], float(rank[key]))
            yield family

    def describe(self):
        return []  # NOTE: no describe-time scrape; families are produced in collect()
