"""GGUF metadata -> ``ModelConfig`` (keys prefixed by the GGUF architecture name)."""

from __future__ import annotations

from typing import Any, Collection

from freetoken.models.checkpoint import gemma_config
from freetoken.models.checkpoint.hf_config import require, serving_context
from freetoken.models.config import LinearAttentionConfig, ModelConfig, MoEConfig
from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.registry import ArchSpec, spec_for_gguf

# GGUF yarn keys (after "{arch}.rope.scaling.") -> the config.json names llama.cpp read them from
_GGUF_YARN_KEYS = {"yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
                   "yarn_attn_factor": "attention_factor"}


def _gguf_rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict | None:
    """The scaling dict config.json would give (see hf_config), or None."""
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type", "none")
    if kind in ("none", None):
        return None
    if kind not in ("linear", "yarn"):
        raise UnsupportedModelError(f"{source}: GGUF rope scaling {kind!r} is not supported "
                                    f"(key {prefix}type; supported: none, linear, yarn)")
    scaling = {"rope_type": kind, "factor": float(require(meta, prefix + "factor", source))}
    if kind == "linear":
        return scaling
    scaling["original_max_position_embeddings"] = int(
        require(meta, prefix + "original_context_length", source))
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


def gguf_spec(meta: dict[str, Any], source: str) -> ArchSpec:
    """The registry entry for a GGUF file's metadata."""
    arch = str(require(meta, "general.architecture", source))
    return spec_for_gguf(arch, source, has_experts=int(meta.get(f"{arch}.expert_count") or 0) > 0)


def _moe_from_gguf(meta: dict[str, Any], spec: ArchSpec, arch: str, layers: int,
                   tensor_names: Collection[str], source: str) -> MoEConfig:
    """Experts from {arch}.expert_*; a layer is sparse where the file has its router."""
    def key(name: str) -> Any:
        return require(meta, f"{arch}.{name}", source)

    inter = meta.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length")
    norm = meta.get(f"{arch}.expert_weights_norm")
    return MoEConfig(
        num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
        intermediate_size=int(inter),
        renormalize=spec.moe.gguf_renormalize if norm is None else bool(norm),
        shared_intermediate_size=int(key("expert_shared_feed_forward_length"))
        if spec.moe.shared_expert else 0,
        sparse_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensor_names
                            for i in range(layers)))


def _hybrid_from_gguf(meta: dict[str, Any], spec: ArchSpec, arch: str, layers: int,
                      source: str) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid model from llama.cpp's ssm.* keys (group_count: key
    heads, time_step_rank: value heads, state_size: key head width, inner_size: value width)
    and its layer pattern; the file's RMSNorm weights already hold 1 + w. (qwen35moe's
    rope.dimension_sections, interleaved M-RoPE, only matters for image positions: text
    positions rotate as plain rope over rope.dimension_count.)"""
    if spec.hybrid is None:
        return {}

    def key(name: str) -> int:
        return int(require(meta, f"{arch}.{name}", source))

    k_heads, v_heads = key("ssm.group_count"), key("ssm.time_step_rank")
    if not k_heads or not v_heads or v_heads % k_heads or key("ssm.inner_size") % v_heads:
        raise ModelFormatError(f"{source}: {arch}.ssm.time_step_rank ({v_heads} value heads) "
                               f"must be a multiple of {arch}.ssm.group_count ({k_heads} key "
                               f"heads) and divide {arch}.ssm.inner_size")
    linear = LinearAttentionConfig(
        num_k_heads=k_heads, num_v_heads=v_heads, head_k_dim=key("ssm.state_size"),
        head_v_dim=key("ssm.inner_size") // v_heads, conv_kernel=key("ssm.conv_kernel"),
        tiled_value_heads=spec.hybrid.gguf_tiled_value_heads and v_heads > k_heads)
    # one flag per block (MTP blocks included, listed after the trunk's), else every n-th
    # layer is full attention as in llama.cpp's loader
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta.get(f"{arch}.full_attention_interval") or 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    elif len(recurrent) < layers:
        raise ModelFormatError(f"{source}: {arch}.attention.recurrent_layers lists "
                               f"{len(recurrent)} layers, the model has {layers}")
    return {"linear": linear, "linear_layers": tuple(bool(r) for r in recurrent[:layers]),
            "attn_output_gate": True, "norm_offset": False,
            "mtp_num_hidden_layers": int(meta.get(f"{arch}.nextn_predict_layers") or 0)}


def config_from_gguf(meta: dict[str, Any], vocab_size: int, source: str,
                     tensor_names: Collection[str] = ()) -> ModelConfig:
    """A ``ModelConfig`` from GGUF metadata; `tensor_names` tells MoE layers from dense ones."""
    spec = gguf_spec(meta, source)
    arch = meta["general.architecture"]

    def key(name: str) -> Any:
        return require(meta, f"{arch}.{name}", source)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    # block_count includes the multi-token-prediction blocks the converter appends (not served)
    layers = int(key("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
           if meta.get(k) is not None]
    eos += gemma_config.gguf_end_of_turn(spec, meta.get("tokenizer.ggml.tokens") or [])
    scaling = _gguf_rope_scaling(meta, arch, source)
    moe = None if spec.moe is None else _moe_from_gguf(meta, spec, arch, layers, tensor_names,
                                                       source)
    dense_inter = meta.get(f"{arch}.feed_forward_length")
    if dense_inter is None and moe is None:
        raise ModelFormatError(f"{source}: missing required key '{arch}.feed_forward_length'")
    if dense_inter is None and spec.hybrid is not None:
        dense_inter = moe.shared_intermediate_size   # no dense MLP: as hf_config reads it
    return ModelConfig(
        architecture=spec.name,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or vocab_size),
        hidden_size=hidden,
        intermediate_size=int(dense_inter or 0),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position=serving_context(int(meta.get(f"{arch}.context_length", 4096)), scaling),
        rope_dim=int(meta.get(f"{arch}.rope.dimension_count") or head_dim),
        rope_scaling=scaling,
        attention_bias=("blk.0.attn_q.bias" in tensor_names) if tensor_names
        else spec.attention.bias,
        qk_norm=spec.attention.qk_norm,
        sliding_window=int(meta.get(f"{arch}.attention.sliding_window") or 0),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
        moe=moe,
        **_hybrid_from_gguf(meta, spec, arch, layers, source),
        **gemma_config.gguf_fields(meta, spec, arch, layers, head_dim),
    )
