"""The Gemma 3 fields of a ``ModelConfig``: which layers slide, the two rope bases, the query
scale, the embedding scale, the GELU gate and the logit soft-cap; from config.json (transformers
4 and 5 spellings) or from GGUF metadata (where llama.cpp fixes what the file does not say)."""

from __future__ import annotations

from typing import Any

from freetoken.models.errors import UnsupportedModelError
from freetoken.models.registry import ArchSpec

GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' default when config.json predates layer_types: every 6th layer is global
DEFAULT_GLOBAL_EVERY = 6


def _hf_activation(cfg: dict[str, Any], source: str) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH_NAMES:
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not supported for "
                                    f"gemma3 (supported: {', '.join(GELU_TANH_NAMES)})")
    return "gelu_tanh"


def _hf_sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(t == "sliding_attention" for t in layer_types)
    every = int(cfg.get("sliding_window_pattern") or DEFAULT_GLOBAL_EVERY)
    return tuple((i + 1) % every != 0 for i in range(layers))


def hf_rope(cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(config.json-style rope keys of the global layers, rope base of the sliding layers).

    transformers 5 writes rope_parameters per layer type; transformers 4 wrote rope_theta,
    rope_scaling (global layers only) and rope_local_base_freq."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = params.get("sliding_attention") or {}
        full.setdefault("rope_theta", 1_000_000.0)
        return {"rope_parameters": full}, float(local.get("rope_theta", 10_000.0))
    keys = {k: cfg[k] for k in ("rope_theta", "rope_scaling") if cfg.get(k) is not None}
    keys.setdefault("rope_theta", 1_000_000.0)
    return keys, float(cfg.get("rope_local_base_freq") or 10_000.0)


def hf_fields(cfg: dict[str, Any], spec: ArchSpec, layers: int, source: str) -> dict[str, Any]:
    """ModelConfig keyword arguments a Gemma config.json sets (none for other families)."""
    if spec.gemma is None:
        return {}
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(f"{source}: attn_logit_softcapping is not supported "
                                    f"(only null, as Gemma 3 ships)")
    hidden = int(cfg["hidden_size"])
    _, local_theta = hf_rope(cfg)
    scalar = cfg.get("query_pre_attn_scalar")
    return {
        "sliding_layers": _hf_sliding_layers(cfg, layers),
        "local_rope_theta": local_theta,
        "activation": _hf_activation(cfg, source),
        "embed_scale": hidden ** 0.5,
        "attn_scale": None if scalar is None else float(scalar) ** -0.5,
        "block_out_norms": True,
        "final_logit_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
    }


def gguf_fields(meta: dict[str, Any], spec: ArchSpec, arch: str, layers: int, head_dim: int
                ) -> dict[str, Any]:
    """ModelConfig keyword arguments for a Gemma GGUF file, read as llama.cpp reads it: the
    window from {arch}.attention.sliding_window, every n-th layer global, the local rope base
    fixed, the query scale 1/sqrt(key_length) and the soft-cap from {arch}.final_logit_softcapping."""
    if spec.gemma is None:
        return {}
    every = spec.attention.gguf_global_every
    hidden = int(meta[f"{arch}.embedding_length"])
    heads = int(meta[f"{arch}.attention.head_count"])
    # llama.cpp: 27B (62 layers) scales by hidden / heads, every other size by key_length
    query_scalar = hidden // heads if layers == 62 else head_dim
    return {
        "sliding_layers": tuple((i + 1) % every != 0 for i in range(layers)),
        "local_rope_theta": spec.attention.gguf_local_rope_theta,
        "activation": "gelu_tanh",
        "embed_scale": hidden ** 0.5,
        "attn_scale": query_scalar ** -0.5,
        "block_out_norms": True,
        "final_logit_softcap": float(meta.get(f"{arch}.final_logit_softcapping") or 0.0),
    }


def gguf_end_of_turn(spec: ArchSpec, tokens: list[str]) -> tuple[int, ...]:
    """The id of <end_of_turn> when the vocabulary has it: Gemma's chat turns stop there."""
    if spec.gemma is None or not tokens:
        return ()
    try:
        return (tokens.index(spec.gemma.gguf_end_of_turn),)
    except ValueError:
        return ()
