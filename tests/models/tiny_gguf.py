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
}


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


def write_gguf(hf_model, tokenizer_dir: Path, path: Path, arch: str, qtype: int | None,
               embed_qtype: int | None = None, skip: tuple[str, ...] = (),
               raw: dict | None = None) -> dict[str, torch.Tensor]:
    """Write `hf_model` as GGUF; 2-D weights quantized to `qtype` (embedding to `embed_qtype`).
    `skip` leaves GGUF tensors out; `raw` maps GGUF names to (uint8 blocks, GGML type) written
    instead of the model's tensor.

    Returns the HF state dict with every quantized weight replaced by its dequantized value,
    for a float reference of exactly what the file holds."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    cfg = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _tokenizer_metadata(writer, tokenizer_dir)
    dequantized = {}
    for name, (blocks, kind) in (raw or {}).items():
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType(kind))
    for name, value in hf_model.state_dict().items():
        if gguf_name(name) in skip or gguf_name(name) in (raw or {}):
            continue
        w = value.float().numpy()
        kind = embed_qtype if name == "model.embed_tokens.weight" else qtype
        if w.ndim == 2 and kind is not None:
            q = quants.quantize(w, GGMLQuantizationType(kind))
            dequantized[name] = torch.from_numpy(quants.dequantize(q, GGMLQuantizationType(kind)))
        else:
            q, kind = w, None
            dequantized[name] = value.float().clone()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            q = interleave_rows(q, heads)
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(q),
                          raw_dtype=None if kind is None else GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized
