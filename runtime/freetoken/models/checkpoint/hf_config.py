"""config.json -> ``ModelConfig``, driven by the architecture's registry entry."""

from __future__ import annotations

from typing import Any

from freetoken.models.checkpoint import gemma_config
from freetoken.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.registry import (HF_NUM_EXPERTS_KEYS, ArchSpec, HybridSpec, MoESpec,
                                       spec_for_hf)



def require(values: dict[str, Any], key: str, source: str) -> Any:
    if key not in values or values[key] is None:
        raise ModelFormatError(f"{source}: missing required key {key!r}")
    return values[key]


def _check_quantization(cfg: dict[str, Any], source: str) -> None:
    """A quantized checkpoint this build cannot run is refused by name, never loaded as
    floats (the schemes it runs: checkpoint/hf_quant.py)."""
    from freetoken.models.checkpoint.hf_quant import parse_scheme

    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "modelopt" \
            and "quant_algo" not in quant:
        return      # named in hf_quant_config.json, checked when the directory is read
    parse_scheme(cfg, None, source)


def _sliding_window(cfg: dict[str, Any], spec: ArchSpec, source: str) -> int:
    """One window for every layer, or none; per-layer mixes are not supported."""
    window = cfg.get("sliding_window") or 0
    if spec.attention.config_window:
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


def serving_context(max_position: int, scaling: dict | None) -> int:
    """Positions the cos/sin table covers: YaRN stretches the original context by `factor`,
    which config.json's max_position_embeddings often leaves out (Qwen2.5's model cards)."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return max_position
    stretched = float(scaling["factor"]) * int(scaling["original_max_position_embeddings"])
    return max(max_position, int(stretched))


def _moe_from_hf(cfg: dict[str, Any], moe: MoESpec, layers: int, source: str) -> MoEConfig:
    key = next((k for k in HF_NUM_EXPERTS_KEYS if cfg.get(k) is not None), HF_NUM_EXPERTS_KEYS[0])
    experts = int(require(cfg, key, source))
    sparse = [experts > 0] * layers
    if moe.sparse_step:      # qwen2_moe / qwen3_moe: dense MLPs between the sparse ones
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    renormalize = moe.renormalize
    if renormalize is None:
        renormalize = bool(cfg.get("norm_topk_prob", False))
    return MoEConfig(
        num_experts=experts, top_k=int(require(cfg, "num_experts_per_tok", source)),
        intermediate_size=int(require(cfg, moe.hf_intermediate, source)),
        renormalize=renormalize,
        shared_intermediate_size=int(require(cfg, "shared_expert_intermediate_size", source))
        if moe.shared_expert else 0,
        sparse_layers=tuple(sparse))


def _check_supported(cfg: dict[str, Any], spec: ArchSpec, source: str) -> None:
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    act = cfg.get("hidden_act", "silu")
    if spec.gemma is None and act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (silu only)")
    if cfg.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{source}: clip_qkv={cfg['clip_qkv']} is not supported "
                                    f"(only null)")
    _check_quantization(cfg, source)


def _attention_bias(cfg: dict[str, Any], spec: ArchSpec) -> bool:
    key = spec.attention.bias_key
    return spec.attention.bias if key is None else bool(cfg.get(key, spec.attention.bias))


def _text_keys(cfg: dict[str, Any], spec: ArchSpec) -> dict[str, Any]:
    """config.json with a multimodal model's text_config lifted to the top level; the lm_head
    belongs to the outer model, so its tie_word_embeddings wins (Qwen3-VL-MoE's text config
    defaults to true where the outer one says false, and transformers unties)."""
    text = cfg.get("text_config")
    if not spec.text_config or not isinstance(text, dict):
        return cfg
    outer = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg}
    return {**cfg, **{k: v for k, v in text.items() if k != "architectures"}, **outer}


def _hybrid_from_hf(cfg: dict[str, Any], hybrid: HybridSpec | None, layers: int,
                    source: str) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid model: its GDN shape and layer pattern."""
    if hybrid is None:
        return {}
    types = cfg.get("layer_types")
    if not types:
        interval = int(cfg.get("full_attention_interval") or 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if len(types) != layers or unknown:
        raise ModelFormatError(f"{source}: layer_types must list {layers} entries of "
                               f"full_attention / linear_attention (got {len(types)}, unknown "
                               f"{unknown})")
    linear = LinearAttentionConfig(
        num_k_heads=int(require(cfg, "linear_num_key_heads", source)),
        num_v_heads=int(require(cfg, "linear_num_value_heads", source)),
        head_k_dim=int(require(cfg, "linear_key_head_dim", source)),
        head_v_dim=int(require(cfg, "linear_value_head_dim", source)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4))
    if linear.num_v_heads % linear.num_k_heads:
        raise ModelFormatError(f"{source}: linear_num_value_heads must be a multiple of "
                               f"linear_num_key_heads")
    return {"linear": linear, "linear_layers": tuple(t == "linear_attention" for t in types),
            "attn_output_gate": True, "norm_offset": True}


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """A ``ModelConfig`` from a parsed config.json."""
    spec = spec_for_hf(cfg, source)
    cfg = _text_keys(cfg, spec)
    if spec.hybrid is not None and "partial_rotary_factor" not in {
            **cfg, **(cfg.get("rope_parameters") or {})}:
        cfg = {**cfg, "partial_rotary_factor": spec.hybrid.partial_rotary_factor}
    _check_supported(cfg, spec, source)
    hidden = int(require(cfg, "hidden_size", source))
    heads = int(require(cfg, "num_attention_heads", source))
    layers = int(require(cfg, "num_hidden_layers", source))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    rope_keys = gemma_config.hf_rope(cfg)[0] if spec.gemma else cfg
    theta, rope_dim, scaling = _rope_from_hf(rope_keys, head_dim, source)
    gemma = gemma_config.hf_fields(cfg, spec, layers, source)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    moe = None if spec.moe is None else _moe_from_hf(cfg, spec.moe, layers, source)
    # qwen3_5_moe has no dense MLP, hence no intermediate_size: the shared expert's stands in
    inter_key = "intermediate_size"
    if spec.hybrid is not None and cfg.get(inter_key) is None:
        inter_key = "shared_expert_intermediate_size"
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(require(cfg, inter_key, source)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=serving_context(int(cfg.get("max_position_embeddings", 4096)), scaling),
        rope_dim=rope_dim,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=_attention_bias(cfg, spec),
        qk_norm=spec.attention.qk_norm,
        sliding_window=int(cfg.get("sliding_window") or 0) if gemma
        else _sliding_window(cfg, spec, source),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=moe,
        mtp_num_hidden_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
        **_hybrid_from_hf(cfg, spec.hybrid, layers, source),
        **gemma,
    )
