"""Speculative decoding totals as Prometheus families, read from engine.stats() at scrape time
(engine/speculative.py keeps them; all zero while speculation is off)."""

from __future__ import annotations

from freetoken.server.offload_metrics import StatsCollector

COUNTERS = (
    ("freetoken_spec_verify_steps", "spec_verify_steps",
     "Sequence steps that verified at least one draft token"),
    ("freetoken_spec_draft_tokens", "spec_draft_tokens", "Draft tokens verified"),
    ("freetoken_spec_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
)
GAUGES = (
    ("freetoken_spec_acceptance_rate", "spec_acceptance_rate",
     "Accepted over verified draft tokens since start"),
    ("freetoken_spec_mean_accepted_length", "spec_mean_accepted_length",
     "Tokens a verify step emits on average (its accepted drafts and one more)"),
)


class SpeculativeCollector(StatsCollector):
    gauges, counters = GAUGES, COUNTERS
