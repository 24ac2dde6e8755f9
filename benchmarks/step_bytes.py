"""Bytes one batch-1 decode step must move, from a checkpoint's own tensor table.

Weights: every tensor one step reads, at its stored size (quantized blocks, FP8/FP4 values and
their scales): attention, norms, routers, dense MLPs, shared experts and the LM head in full;
routed expert tensors scaled by top_k / num_experts (uniform routing); the embedding table not
at all (one row is read), unless the LM head is tied to it. Context: K and V of every attention
layer at `context` positions (2 bytes each, the engines' bf16/f16 caches), and for Gated
DeltaNet layers their recurrent state (float32) and conv window, read and written.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

KV_ITEM = 2
# safetensors dtype -> bytes per element
_ITEM = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 1, "I8": 1,
         "I32": 4, "I64": 8, "BOOL": 1}


def gguf_weight_bytes(path: Path) -> dict:
    """{"weights", "experts", "by_type"} of a GGUF file (read with gguf's GGUFReader)."""
    from benchmarks.llama_cpp_cuda.paths import import_gguf

    reader = import_gguf().GGUFReader(str(path))

    def field(suffix: str) -> int | None:
        for f in reader.fields.values():
            if f.name.endswith(suffix) and f.data:
                return int(f.parts[f.data[0]][0])
        return None

    experts, used = field(".expert_count"), field(".expert_used_count")
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    total, routed, by_type = 0.0, 0.0, {}
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue
        nbytes = float(t.n_bytes)
        if "_exps." in t.name and experts:
            nbytes *= used / experts
            routed += nbytes
        total += nbytes
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + nbytes
    return {"weights": int(total), "experts": int(routed),
            "by_type": {k: int(v) for k, v in sorted(by_type.items())}}


def _safetensors_header(file: Path) -> dict:
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def text_config(config: dict) -> dict:
    """The text model's keys (nested under text_config in vision-language configs)."""
    return {**config, **config["text_config"]} if "text_config" in config else config


def safetensors_weight_bytes(folder: Path) -> dict:
    """{"weights", "experts", "by_type"} of an HF folder, from its safetensors headers."""
    cfg = text_config(json.loads((folder / "config.json").read_text()))
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    used = cfg.get("num_experts_per_tok")
    tied = bool(cfg.get("tie_word_embeddings"))
    total, routed, by_type = 0.0, 0.0, {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, info in _safetensors_header(file).items():
            if name == "__metadata__" or (name.endswith("embed_tokens.weight") and not tied):
                continue
            count = 1
            for n in info["shape"]:
                count *= n
            nbytes = float(count * _ITEM[info["dtype"]])
            if ".experts." in name and experts:
                nbytes *= used / experts
                routed += nbytes
            total += nbytes
            by_type[info["dtype"]] = by_type.get(info["dtype"], 0) + nbytes
    return {"weights": int(total), "experts": int(routed),
            "by_type": {k: int(v) for k, v in sorted(by_type.items())}}


def kv_item_bytes(config: dict, kv_dtype: str) -> float:
    """Bytes an element of the KV pool takes: 2 for a 16-bit pool; 1 for `fp8`, plus its
    float32 scale per token and KV head spread over the head's elements."""
    if kv_dtype != "fp8":
        return KV_ITEM
    cfg = text_config(config)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 1 + 4 / head_dim


def context_bytes(config: dict, context: int, kv_item: float = KV_ITEM) -> float:
    """KV of `context` positions in every attention layer, plus each Gated DeltaNet layer's
    float32 state and conv window read and written (`config`: an HF config.json dict).
    `kv_item`: the pool's bytes an element (kv_item_bytes)."""
    cfg = text_config(config)
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types") or ["full_attention"] * layers
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = 2 * cfg["num_key_value_heads"] * head_dim * kv_item * context
    total = 0
    for kind in kinds:
        if kind == "linear_attention":
            key = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
            value = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
            conv = 2 * key + value
            total += 2 * (4 * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"]
                          * cfg["linear_value_head_dim"]
                          + KV_ITEM * conv * (cfg["linear_conv_kernel_dim"] - 1))
        else:
            total += kv
    return total
