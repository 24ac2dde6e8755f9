"""The supported dense architectures and their config readers: the single source of truth.

An architecture is found by its registry name, by an HF ``architectures`` class name, or by a
GGUF ``general.architecture`` string; each maps to an ``ArchSpec`` whose flags drive the shared
readers below (HF config.json dicts and GGUF metadata dicts both become a ``ModelConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetoken.models.config import ModelConfig
from freetoken.models.errors import ModelFormatError, UnsupportedModelError


@dataclass(frozen=True)
class ArchSpec:
    """What differs between the dense decoders that share ``DenseDecoder``."""

    name: str
    hf_classes: tuple[str, ...]
    gguf_names: tuple[str, ...]
    attention_bias: bool = False     # q/k/v projections always carry a bias (qwen2)
    qk_norm: bool = False            # per-head RMSNorm on q and k before rope (qwen3)
    gguf_permuted_qk: bool = False   # llama.cpp's converter interleaved the q/k rows for rope


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec for spec in (
        ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), gguf_permuted_qk=True),
        ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), attention_bias=True),
        ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True),
        ArchSpec("mistral", ("MistralForCausalLM",), ()),
    )
}


def supported_names() -> list[str]:
    """Every accepted spelling: registry names, HF classes and GGUF architecture strings."""
    names = set(ARCHITECTURES)
    for spec in ARCHITECTURES.values():
        names.update(spec.hf_classes)
        names.update(spec.gguf_names)
    return sorted(names)


def _unsupported(what: str, source: str) -> UnsupportedModelError:
    listed = ", ".join(sorted(ARCHITECTURES))
    classes = ", ".join(c for s in ARCHITECTURES.values() for c in s.hf_classes)
    return UnsupportedModelError(
        f"{source}: architecture {what!r} is not supported; supported: {listed} "
        f"(HF classes {classes}; GGUF llama, qwen2, qwen3)")


def spec_for_name(name: str, source: str = "model") -> ArchSpec:
    """The spec for a registry name (llama, qwen2, qwen3, mistral)."""
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise _unsupported(name, source)
    return spec


def spec_for_hf(hf_config: dict[str, Any], source: str) -> ArchSpec:
    """The spec named by config.json's ``architectures`` (or ``model_type`` when absent)."""
    classes = hf_config.get("architectures") or []
    for cls in classes:
        for spec in ARCHITECTURES.values():
            if cls in spec.hf_classes:
                return spec
    if not classes and hf_config.get("model_type") in ARCHITECTURES:
        return ARCHITECTURES[hf_config["model_type"]]
    raise _unsupported(", ".join(classes) or str(hf_config.get("model_type")), source)


def spec_for_gguf(arch: str, source: str) -> ArchSpec:
    """The spec for a GGUF ``general.architecture`` value."""
    for spec in ARCHITECTURES.values():
        if arch in spec.gguf_names:
            return spec
    raise _unsupported(arch, source)


def _require(values: dict[str, Any], key: str, source: str) -> Any:
    if key not in values or values[key] is None:
        raise ModelFormatError(f"{source}: missing required key {key!r}")
    return values[key]


def _sliding_window(cfg: dict[str, Any], spec: ArchSpec, source: str) -> int:
    """One window for every layer, or none; per-layer mixes are not supported."""
    window = cfg.get("sliding_window") or 0
    if spec.name == "mistral":
        return int(window)
    layer_types = cfg.get("layer_types") or []
    sliding = [t == "sliding_attention" for t in layer_types]
    if cfg.get("use_sliding_window") and not layer_types:
        sliding = [True]
    if not any(sliding):
        return 0
    if not all(sliding):
        raise UnsupportedModelError(
            f"{source}: sliding-window attention on only some layers is not supported "
            f"(layer_types mixes full and sliding); use a model with one attention kind")
    return int(window)


def _rope_from_hf(cfg: dict[str, Any], head_dim: int, source: str
                  ) -> tuple[float, int, dict | None]:
    """(theta, rotated dims, scaling dict or None) from transformers 5 or 4 style keys."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    scaling = {k: v for k, v in {**legacy, **params}.items()
               if k not in ("rope_theta", "partial_rotary_factor")}
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return theta, int(head_dim * factor), None
    # transformers prefers a top-level pretraining length over the one in the scaling dict
    if kind in ("llama3", "yarn") and cfg.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if kind == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ModelFormatError(
                    f"{source}: yarn rope scaling is missing {key!r} (add it to rope_parameters "
                    f"or rope_scaling; the model card gives the value)")
    return theta, int(head_dim * factor), scaling


def _serving_context(max_position: int, scaling: dict | None) -> int:
    """Positions the cos/sin table covers: YaRN stretches the original context by `factor`,
    which config.json's max_position_embeddings often leaves out (Qwen2.5's model cards)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return max_position
    stretched = float(scaling["factor"]) * int(scaling["original_max_position_embeddings"])
    return max(max_position, int(stretched))


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A ``ModelConfig`` from a parsed config.json."""
    spec = spec_for_hf(cfg, source)
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu only)")
    hidden = int(_require(cfg, "hidden_size", source))
    heads = int(_require(cfg, "num_attention_heads", source))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, rope_dim, scaling = _rope_from_hf(cfg, head_dim, source)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(_require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", source)),
        num_layers=int(_require(cfg, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=_serving_context(int(cfg.get("max_position_embeddings", 4096)), scaling),
        rope_dim=rope_dim,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=spec.attention_bias or bool(cfg.get("attention_bias", False)),
        qk_norm=spec.qk_norm,
        sliding_window=_sliding_window(cfg, spec, source),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


# GGUF yarn keys (after "{arch}.rope.scaling.") -> the config.json names llama.cpp read them from
_GGUF_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                   "yarn_attn_factor": "attention_factor"}


def _gguf_rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict | None:
    """The scaling dict config.json would give (see ``_rope_from_hf``), or None."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type", "none")
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"{source}: GGUF rope scaling {kind!r} is not supported "
                                    f"(key {prefix}type; supported: none, linear, yarn)")
    scaling = {"rope_type": kind, "factor": float(_require(meta, prefix + "factor", source))}
    if kind == "linear":
        return scaling
    scaling["original_max_position_embeddings"] = int(
        _require(meta, prefix + "original_context_length", source))
    for gguf_name, hf_name in _GGUF_YARN_KEYS.items():
        if meta.get(prefix + gguf_name) is not None:
            scaling[hf_name] = float(meta[prefix + gguf_name])
    # settings transformers' YaRN cannot express; llama.cpp reads ext factor -1 as 1
    for gguf_name, plain in (("yarn_ext_factor", (1.0, -1.0)), ("yarn_log_multiplier", (0.0,))):
        value = meta.get(prefix + gguf_name)
        if value is not None and float(value) not in plain:
            raise UnsupportedModelError(
                f"{source}: {prefix}{gguf_name} = {value} is not supported with yarn "
                f"(supported: {plain[0]} or absent)")
    return scaling


def config_from_gguf(meta: dict[str, Any], vocab_size: int, source: str) -> ModelConfig:
    """A ``ModelConfig`` from GGUF metadata (keys prefixed by the architecture name)."""
    arch = _require(meta, "general.architecture", source)
    spec = spec_for_gguf(arch, source)

    def key(name: str) -> Any:
        return _require(meta, f"{arch}.{name}", source)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if meta.get(k) is not None]
    scaling = _gguf_rope_scaling(meta, arch, source)
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=_serving_context(int(meta.get(f"{arch}.context_length", 4096)), scaling),
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count") or head_dim),
        rope_scaling=scaling,
        attention_bias=spec.attention_bias,
        qk_norm=spec.qk_norm,
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window") or 0),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )
