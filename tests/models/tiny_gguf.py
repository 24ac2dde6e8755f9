"""Write a tiny HF model as GGUF the way llama.cpp's converter lays it out (names, q/k row
interleaving for llama, GGML block quantization from the `gguf` package)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

LAYER_PARTS = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    # MoE, as transformers holds it in memory; gate_up_proj is split in two by write_gguf
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# llama.cpp's architecture strings; Mixtral is written as llama with experts
GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
             "olmoe": "olmoe"}
# kept in float32 by llama.cpp's converter whatever the file type
FLOAT_ONLY = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's permutation: per head, rows of the two rope halves alternate."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = hf_name.split(".", 3)
    if rest.startswith("mlp.experts.gate_up_proj."):
        return f"blk.{index}.ffn_{rest.rsplit('.', 1)[1]}_exps.weight"
    return f"blk.{index}.{LAYER_PARTS[rest]}"


def _tokenizer_metadata(writer, tokenizer_dir: Path) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    writer.add_chat_template(config["chat_template"])


def _moe_metadata(writer, cfg) -> None:
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None)
                                          or cfg.intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _split_experts(state: dict) -> dict:
    """transformers' fused [E, 2I, H] gate_up_proj as llama.cpp's two stacked tensors."""
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            out[name + ".gate"], out[name + ".up"] = gate, up
        else:
            out[name] = value
    return out


def _merge_experts(state: dict) -> dict:
    merged = {}
    for name, value in state.items():
        if name.endswith("gate_up_proj.gate") and name[:-5] + ".up" in state:
            merged[name[:-5]] = torch.cat([value, state[name[:-5] + ".up"]], dim=1)
        elif not name.endswith("gate_up_proj.up"):
            merged[name] = value
    return merged


def write_gguf(hf_model, tokenizer_dir: Path, path: Path, arch: str, qtype: int | None,
               embed_qtype: int | None = None, skip: tuple[str, ...] = (),
               raw: dict | None = None, float_type: int | None = None,
               quantize_only: tuple[str, ...] = (),
               split_max_tensors: int = 0) -> dict[str, torch.Tensor]:
    """Write `hf_model` as GGUF; 2-D and stacked-expert 3-D weights quantized to `qtype`
    (embedding to `embed_qtype`), else stored as `float_type` (F32 by default, or F16).
    `skip` leaves GGUF tensors out; `raw` maps GGUF names to (uint8 blocks, GGML type) written
    instead of the model's tensor; `quantize_only` (GGUF name endings) limits `qtype` to those.
    `split_max_tensors` > 0 splits the model as gguf-split does: `path`'s stem plus
    -00001-of-0000N.gguf, ... with at most that many tensors each.

    Returns the HF state dict with every weight replaced by the value the file holds
    (dequantized or rounded), for a float reference of exactly what the file holds."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = GGUFWriter(str(path), GGUF_ARCH.get(arch, arch), split_max_tensors=split_max_tensors)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if arch in GGUF_ARCH:
        _moe_metadata(writer, cfg)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _tokenizer_metadata(writer, tokenizer_dir)
    dequantized = {}
    for name, (blocks, kind) in (raw or {}).items():
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType(kind))
    for name, value in _split_experts(hf_model.state_dict()).items():
        if gguf_name(name) in skip or gguf_name(name) in (raw or {}):
            continue
        w = value.float().numpy()
        if gguf_name(name).endswith(FLOAT_ONLY) or (
                quantize_only and not gguf_name(name).endswith(quantize_only)):
            w = w.reshape(-1) if w.shape[0] == 1 else w    # the shared gate is [H] in GGUF
            kind = None
        else:
            kind = embed_qtype if name == "model.embed_tokens.weight" else qtype
        if w.ndim >= 2 and kind is not None:
            q = quants.quantize(w, GGMLQuantizationType(kind))
            dequantized[name] = torch.from_numpy(quants.dequantize(q, GGMLQuantizationType(kind)))
        elif w.ndim >= 2 and float_type == GGMLQuantizationType.F16:
            q, kind = w.astype(np.float16), None
            dequantized[name] = torch.from_numpy(q.astype(np.float32))
        else:
            q, kind = w, None
            dequantized[name] = value.float().clone()
        if arch in ("llama", "mixtral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            q = interleave_rows(q, heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(q),
                          raw_dtype=None if kind is None else GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _merge_experts(dequantized)
