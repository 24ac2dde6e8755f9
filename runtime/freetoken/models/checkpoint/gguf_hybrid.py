"""The Gated DeltaNet tensors of llama.cpp's qwen3next / qwen35moe GGUF files, given back the
meaning their HF names have (the canonical parts of registry.py) as the GGUF reader hands them out.

What llama.cpp's converter (convert_hf_to_gguf.py, Qwen3NextModel and its qwen35 subclasses)
changed, and how it is undone here:

- ``ssm_a`` holds -exp(A_log): A_log = log(-ssm_a), in float32.
- qwen35 / qwen35moe with more value heads than key heads: every tensor indexed by value head
  has them tiled over the key heads (value head i * Hk + g reads key head g, so that ggml's
  broadcast repeats the key heads) where HF groups them by key head (g * Hv/Hk + i): the v rows
  of attn_qkv and of the conv, attn_gate (z), ssm_beta, ssm_alpha, ssm_dt and ssm_a. They are
  read back in grouped order, whole rows in whatever format the file has. ssm_out's columns
  stay tiled: moving them would split quantized blocks (a K-quant block spans two 128-wide
  heads), so the forward reorders its input instead (``LinearAttentionConfig.tiled_value_heads``).
- RMSNorm weights hold 1 + w: the config says so (gguf_config.py), nothing changes here.
- The conv weight is stored squeezed, [C, K] as the canonical part reads it.
"""

from __future__ import annotations

import numpy as np

from freetoken.models.config import LinearAttentionConfig, QuantWeight
from freetoken.models.errors import ModelFormatError

# parts whose rows are value heads of this width (None: head_v_dim), after `offset` leading rows
_VALUE_HEAD_ROWS = {"gdn.z": None, "gdn.b": 1, "gdn.a": 1, "gdn.dt_bias": 1, "gdn.A_log": 1}
_QKV_PARTS = ("gdn.qkv", "gdn.conv")   # q and k rows first, then the value heads


def grouped_order(num_k_heads: int, num_v_heads: int, width: int) -> np.ndarray:
    """Row index that takes `width`-row value heads from tiled to grouped order:
    grouped row (g * r + i) * width + c is tiled row (i * Hk + g) * width + c, r = Hv / Hk."""
    r = num_v_heads // num_k_heads
    index = np.arange(num_v_heads * width).reshape(r, num_k_heads, width)
    return index.transpose(1, 0, 2).reshape(-1)


def value_head_index(part: str, lin: LinearAttentionConfig) -> np.ndarray | None:
    """The rows of `part` in grouped order, for a file whose value heads are tiled; None for
    parts that have no value-head rows."""
    if part in _QKV_PARTS:
        keys = np.arange(2 * lin.key_dim)
        values = grouped_order(lin.num_k_heads, lin.num_v_heads, lin.head_v_dim)
        return np.concatenate([keys, 2 * lin.key_dim + values])
    if part in _VALUE_HEAD_ROWS:
        width = _VALUE_HEAD_ROWS[part] or lin.head_v_dim
        return grouped_order(lin.num_k_heads, lin.num_v_heads, width)
    return None


def canonical(part: str, weight, lin: LinearAttentionConfig, file_name: str, source: str):
    """`weight` (as the file stores `part`, rows = output features) with its HF meaning."""
    if part == "gdn.A_log":
        if isinstance(weight, QuantWeight):
            raise ModelFormatError(f"{source}: tensor {file_name!r} is block-quantized; "
                                   f"llama.cpp's converter writes it as F32")
        with np.errstate(divide="ignore", invalid="ignore"):
            weight = np.log(-np.asarray(weight, dtype=np.float32))
    if not lin.tiled_value_heads:
        return weight
    index = value_head_index(part, lin)
    if index is None or weight.shape[0] != len(index):
        return weight       # not a value-head part, or a shape the weight reader refuses
    if isinstance(weight, QuantWeight):
        return QuantWeight(weight.qtype, weight.data[index], weight.shape)
    return weight[index]


# The MTP block as llama.cpp's converter writes it (_Qwen35MtpMixin in conversion/qwen.py):
# block_count grows by {arch}.nextn_predict_layers, MTP decoder layer k becomes block
# num_layers + k (named as any layer: attn_q holds the gated q, post_attention_norm, ffn_*),
# and the block's own tensors sit in block num_layers under nextn.*. Norms hold 1 + w there too.
MTP_NAMES = {"mtp.fc": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding": "nextn.enorm.weight",
             "mtp.pre_fc_norm_hidden": "nextn.hnorm.weight",
             "mtp.norm": "nextn.shared_head_norm.weight"}


def mtp_file_name(name: str, num_layers: int) -> str:
    """The GGUF name of one of the MTP block's own tensors (``mtp.fc``, ...)."""
    if name not in MTP_NAMES:
        raise KeyError(name)
    return f"blk.{num_layers}.{MTP_NAMES[name]}"


class MTPBlocks:
    """The MTP block of a GGUF file under the names forward/mtp.py reads (see HFTensors.mtp):
    ``mtp.*`` as they are, decoder layer k (``layers.{k}.*``) from block num_layers + k."""

    def __init__(self, src, num_layers: int):
        self.src, self.first = src, num_layers
        self.source = src.source

    def _name(self, name: str) -> str:
        if not name.startswith("layers."):
            return name
        _, index, part = name.split(".", 2)
        return f"layers.{self.first + int(index)}.{part}"

    def get(self, name: str):
        return self.src.get(self._name(name))

    def file_name(self, name: str) -> str:
        return self.src.file_name(self._name(name))

    def stored(self, name: str):
        return self.src.stored(self._name(name))

    def release(self, name: str) -> None:
        self.src.release(self._name(name))


def mtp_view(src, num_layers: int) -> MTPBlocks | None:
    """The MTP block of GGUF tensor source `src` (a model of `num_layers` layers), or None
    when the file has none (no nextn.eh_proj in block num_layers)."""
    if src.stored("mtp.fc") is None:
        return None
    return MTPBlocks(src, num_layers)
