"""Admission and request outcomes as Prometheus families, read from engine.stats() at scrape
time: every accepted request ends with one finish reason, every refused one is counted by why
it was refused."""

from __future__ import annotations

from typing import Any, Callable

from freetoken.engine.admission import REFUSAL_REASONS
from freetoken.engine.request import FINISH_REASONS


class AdmissionCollector:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        self._engine_stats = engine_stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._engine_stats()
        finished = CounterMetricFamily(
            "freetoken_requests_finished", "Accepted requests that ended, by finish reason "
            "(stop, length, abort: the client left or the server stopped, error)",
            labels=["reason"])
        for reason in FINISH_REASONS:
            finished.add_metric([reason], stats.get(f"requests_finished_{reason}", 0))
        yield finished
        refused = CounterMetricFamily(
            "freetoken_requests_refused", "Requests refused at admission with 503/529 "
            "(queue_full, shutting_down)", labels=["reason"])
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], stats.get(f"requests_refused_{reason}", 0))
        yield refused
        yield GaugeMetricFamily("freetoken_max_queued_requests",
                                "Most requests waiting beyond the running ones",
                                value=stats.get("max_queued_requests", 0))

    def describe(self):
        return []  # NOTE: no describe-time scrape; families are produced in collect()
