"""Write a tiny hybrid HF model (qwen3_next, qwen3_5_moe) as GGUF the way llama.cpp's converter
does (convert_hf_to_gguf.py: Qwen3NextModel, and for qwen35moe its value-head reordering
subclass), with the `gguf` package: what CI machines without llama.cpp's sources test against.
test_hybrid_gguf.py checks the result against the converter's own file where it is staged.

Written from the converter's code, not from FreeToken's registry, so that a wrong name or a
missing transform in the reader shows up as a logits mismatch:
- names: post_attention_layernorm -> post_attention_norm, linear_attn.* -> attn_qkv, attn_gate,
  ssm_beta / ssm_alpha (qwen35) or ssm_ba (qwen3next), ssm_conv1d, ssm_dt.bias, ssm_a,
  ssm_norm, ssm_out; qwen3next's in_proj_qkvz is split into attn_qkv (q, k, v of every head)
  and attn_gate (z);
- values: ssm_a = -exp(A_log), RMSNorm weights + 1 (not the GDN output norm), the conv
  squeezed to [C, K]; qwen35: value heads from grouped by key head to tiled.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.models.tiny_gguf import _merge_experts, _split_experts, _tokenizer_metadata

GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe"}
LAYER_NAMES = {   # under model.layers.{i}. -> under blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",     # older qwen3next files
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.gate_up_proj.gate": "ffn_gate_exps.weight",
    "mlp.experts.gate_up_proj.up": "ffn_up_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
# kept in float32 by the converter whatever the file type (besides vectors and norms)
FLOAT_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def tile_value_heads(w: torch.Tensor, dim: int, cfg, width: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads (`width` wide along `dim`) from grouped by
    key head [k0: v0..v(r-1), k1: ...] to tiled [k0 v0, k1 v0, ..., k0 v1, ...]."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    shape = list(w.shape)
    split = shape[:dim] + [hk, hv // hk, width] + shape[dim + 1:]
    return w.reshape(split).transpose(dim, dim + 1).reshape(shape)


def _value_rows_tiled(name: str, w: torch.Tensor, cfg) -> torch.Tensor:
    """qwen35: every tensor indexed by value head, reordered (the converter's modify_tensors)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    qk = 2 * cfg.linear_num_key_heads * dk
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return torch.cat([w[:qk], tile_value_heads(w[qk:], 0, cfg, dv)])
    if name.endswith("in_proj_z.weight"):
        return tile_value_heads(w, 0, cfg, dv)
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return tile_value_heads(w, 0, cfg, 1)
    if name.endswith("out_proj.weight"):
        return tile_value_heads(w, 1, cfg, dv)
    return w


def _split_qkvz(name: str, w: torch.Tensor, cfg) -> dict[str, torch.Tensor]:
    """qwen3next: in_proj_qkvz (per key head [q | k | v | z]) as attn_qkv and attn_gate."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    group_v = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    q, k, v, z = w.reshape(hk, -1, w.shape[-1]).split([dk, dk, group_v, group_v], dim=1)
    base = name.replace("in_proj_qkvz", "in_proj_qkv")
    flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
    return {base: torch.cat(flat[:3]), name.replace("in_proj_qkvz", "in_proj_z"): flat[3]}


def converter_tensors(hf_model, arch: str,
                      legacy_qkvz: bool = False) -> dict[str, torch.Tensor]:
    """HF name -> the tensor the converter writes for it, float32 (qwen3next's in_proj_qkvz
    becomes two entries unless `legacy_qkvz`: older converters kept it whole as ssm_in;
    transformers' fused experts gate_up_proj becomes two as well)."""
    cfg = hf_model.config
    out = {}
    for name, value in _split_experts(hf_model.state_dict()).items():
        w = value.detach().float().clone()
        if name.endswith("in_proj_qkvz.weight") and not legacy_qkvz:
            out.update(_split_qkvz(name, w, cfg))
            continue
        if arch == "qwen3_5_moe" and cfg.linear_num_value_heads != cfg.linear_num_key_heads:
            w = _value_rows_tiled(name, w, cfg)
        if name.endswith("A_log"):
            w = -torch.exp(w)
        elif name.endswith("conv1d.weight"):
            w = w.squeeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        out[name] = w
    return out


def _metadata(writer, cfg, arch: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    if arch == "qwen3_next":
        writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    writer.add_ssm_state_size(cfg.linear_key_head_dim)
    writer.add_ssm_group_count(cfg.linear_num_key_heads)
    writer.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    writer.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    prefix = writer.arch
    writer.add_array(f"{prefix}.attention.recurrent_layers",
                     [t == "linear_attention" for t in cfg.layer_types])
    if arch == "qwen3_5_moe":    # interleaved M-RoPE sections (text positions ignore them)
        writer.add_array(f"{prefix}.rope.dimension_sections", [11, 11, 10, 0])
    writer.add_uint32(f"{prefix}.full_attention_interval",
                      getattr(cfg, "full_attention_interval", None) or 4)
    rotary = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    writer.add_rope_dimension_count(int(cfg.head_dim * rotary))


def _stays_float(target: str, ndim: int) -> bool:
    return ndim < 2 or target.endswith(FLOAT_ONLY)


def write_hybrid_gguf(hf_model, tokenizer_dir: Path, path: Path, arch: str,
                      qtype: int | None = None, legacy_qkvz: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Write `hf_model` as the converter would with outtype bf16 (qtype None) or `qtype`
    (2-D and stacked weights; vectors, norms, the router, the shared-expert gate and the conv
    stay float32); `legacy_qkvz`: qwen3next as older converters wrote it.

    Returns the HF state dict holding exactly the file's values (rounded or dequantized), for
    a float reference. Blocks run along rows, which the converter's row moves keep whole; its
    column move of ssm_out keeps them whole when a value head spans whole blocks (asserted),
    so rounding each HF tensor as it is gives the file's values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

    cfg = hf_model.config
    kind = GGMLQuantizationType(GGMLQuantizationType.BF16 if qtype is None else qtype)
    if arch == "qwen3_5_moe":
        assert cfg.linear_value_head_dim % GGML_QUANT_SIZES[kind][0] == 0, \
            "ssm_out's blocks would not move whole"
    writer = GGUFWriter(str(path), GGUF_ARCH[arch])
    _metadata(writer, cfg, arch)
    _tokenizer_metadata(writer, tokenizer_dir)
    for name, w in converter_tensors(hf_model, arch, legacy_qkvz).items():
        array, target = w.numpy(), gguf_name(name)
        if _stays_float(target, array.ndim):
            writer.add_tensor(target, np.ascontiguousarray(array))
        else:
            writer.add_tensor(target, quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    held = {}
    for name, value in _split_experts(hf_model.state_dict()).items():
        w = value.detach().float().numpy()
        target = gguf_name(name)
        if not _stays_float(target, w.ndim):
            w = quants.dequantize(quants.quantize(w, kind), kind).reshape(w.shape)
        held[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    return _merge_experts(held)
