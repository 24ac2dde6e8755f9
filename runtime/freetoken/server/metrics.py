"""Prometheus metrics: one registry per app, gauges refreshed from engine.stats() on scrape."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

# engine.stats() keys exported as freetoken_model_<key>
MODEL_GAUGES = {
    "num_params": "Weights of the served model",
    "active_params_per_token": "Weights one token computes with (MoE: the routed experts only)",
    "num_experts": "Routed experts per MoE layer (0 for a dense model)",
    "experts_per_token": "Experts each token is routed to per MoE layer (0 for a dense model)",
}
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


STATE_GAUGES = {
    "state_slots_used": "Recurrent-state slots held by running sequences (hybrid models)",
    "state_slots_total": "Recurrent-state slots in the pool (hybrid models)",
    "state_bytes_total": "Bytes of the recurrent-state pool (hybrid models)",
}


class Metrics:
    """Counters and histograms the routes feed; `render()` is the /metrics body."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self._engine_stats = engine_stats
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("freetoken_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=registry)
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "Prompt tokens accepted",
                                     registry=registry)
        self.generation_tokens = Counter("freetoken_generation_tokens", "Tokens generated",
                                         registry=registry)
        self.ttft = Histogram("freetoken_time_to_first_token_seconds",
                              "Time from request arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("freetoken_e2e_request_latency_seconds",
                             "Time from request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.kv_usage = Gauge("freetoken_kv_cache_usage_ratio",
                              "Fraction of KV pages in use", registry=registry)
        self.running = Gauge("freetoken_num_requests_running", "Requests holding KV pages",
                             registry=registry)
        self.waiting = Gauge("freetoken_num_requests_waiting", "Requests queued for KV pages",
                             registry=registry)
        self.model = {key: Gauge(f"freetoken_model_{key}", help_text, registry=registry)
                      for key, help_text in MODEL_GAUGES.items()}
        # hybrid models: the recurrent-state pool beside the KV pool (0 for other models)
        self.states = {key: Gauge(f"freetoken_{key}", help_text, registry=registry)
                       for key, help_text in STATE_GAUGES.items()}
        registry.register(PrefixCacheCollector(engine_stats))
        from freetoken.server.offload_metrics import OffloadCollector

        registry.register(OffloadCollector(engine_stats))
        from freetoken.server.parallel_metrics import ParallelCollector

        registry.register(ParallelCollector(engine_stats))
        from freetoken.server.admission_metrics import AdmissionCollector

        registry.register(AdmissionCollector(engine_stats))
        from freetoken.server.speculative_metrics import SpeculativeCollector

        registry.register(SpeculativeCollector(engine_stats))

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        stats = self._engine_stats()
        self.kv_usage.set(stats["kv_occupancy"])
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        for key, gauge in self.model.items():
            gauge.set(stats[key])
        for key, gauge in self.states.items():
            gauge.set(stats.get(key, 0))
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class PrefixCacheCollector:
    """The engine's prefix-cache totals as Prometheus counters, read at scrape time (the engine
    keeps the running totals, so nothing is double counted)."""

    COUNTERS = (
        ("freetoken_prefix_cache_queried_tokens", "prefix_cache_queried_tokens",
         "Prompt tokens looked up in the prefix cache"),
        ("freetoken_prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
         "Prompt tokens whose KV came from the prefix cache"),
        ("freetoken_prefix_cache_evictions", "prefix_cache_evictions",
         "Cached KV pages evicted to make room"),
    )

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        self._engine_stats = engine_stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        stats = self._engine_stats()
        for name, key, doc in self.COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key, 0))

    def describe(self):
        return []  # NOTE: no describe-time scrape; families are produced in collect()


class RequestTimer:
    """Tracks one request: feed it every engine output."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._start = time.monotonic()
        self._first_token_seen = False
        self.prompt_tokens = 0

    def on_output(self, output: Any) -> None:
        if output.token_ids and not self._first_token_seen:
            self._first_token_seen = True
            self._metrics.ttft.observe(time.monotonic() - self._start)
        if output.finished:
            self._metrics.e2e.observe(time.monotonic() - self._start)
            self._metrics.prompt_tokens.inc(output.usage.prompt_tokens)
            self._metrics.generation_tokens.inc(output.usage.completion_tokens)


# ---- routes: /health, /v1/stats, /metrics ------------------------------------------------------

def create_admin_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx = request.app.state.ctx
        # pid: `ft ctl health --pid` tells its own server from another one on the same port
        if not ctx.engine.is_alive:
            return JSONResponse({"status": "error", "model": ctx.model_name, "pid": os.getpid(),
                                 "message": "the engine is not running"}, status_code=503)
        return JSONResponse({"status": "ok", "model": ctx.model_name, "pid": os.getpid()})

    @router.get("/v1/stats")
    async def stats(request: Request) -> JSONResponse:
        ctx = request.app.state.ctx
        return JSONResponse({"model": ctx.model_name, **ctx.engine.stats()})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = request.app.state.ctx.metrics.render()
        return Response(body, media_type=content_type)

    return router
