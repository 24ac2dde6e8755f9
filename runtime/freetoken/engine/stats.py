"""What /v1/stats and /metrics say about an engine beside its live counts: its settings, the
model's size and routing, its pools and its parallel layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from freetoken.engine.live_resize import pool_stats

if TYPE_CHECKING:
    from freetoken.engine.engine import Engine

DEFAULT_KEYS = ("temperature", "top_k", "top_p", "max_tokens")


def settings_stats(engine: Engine) -> dict[str, Any]:
    """The engine's settings, model and pools (Engine.stats adds the live counts)."""
    config, defaults = engine.config, engine.generation_defaults
    model_defaults = {k: getattr(defaults, k) for k in DEFAULT_KEYS} if defaults else {}
    stats = dict(
        sampling_defaults=config.sampling_defaults,
        model_generation_defaults={k: v for k, v in model_defaults.items() if v is not None},
        max_num_seqs=config.max_num_seqs,
        max_prefill_tokens=config.max_prefill_tokens,
        max_request_tokens=engine.max_request_tokens,
        device=str(engine.model.device),
        kv_dtype=engine.kv_dtype,
        # the drafting in use ("off" when this model or engine cannot verify drafts: see
        # speculative_off_because)
        speculative=engine.drafter.method if engine.drafter is not None else "off",
        num_speculative_tokens=engine.drafter.num_tokens if engine.drafter is not None else 0,
        speculative_off_because=engine.speculation_off_because,
        **model_stats(engine.model.config),
        cuda_graph_capture_s=engine.graphs.capture_seconds if engine.graphs else None,
        **pool_stats(engine))
    stats.update(engine.model.parallel_stats() if hasattr(engine.model, "parallel_stats")
                 else {"tensor_parallel_size": 1})
    return stats


def model_stats(config: Any) -> dict[str, Any]:
    """What /v1/stats and /metrics say about the model: its size and, for MoE, its routing."""
    moe = config.moe
    return {"architecture": config.architecture, "num_params": config.num_params,
            "active_params_per_token": config.active_params_per_token,
            "num_experts": moe.num_experts if moe else 0,
            "experts_per_token": moe.top_k if moe else 0,
            "moe_layers": sum(moe.sparse_layers) if moe else 0}
