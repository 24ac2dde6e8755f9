"""Layer weights of the hybrid models (Qwen3-Next, Qwen3.5/3.6): Gated DeltaNet layers and
gated full-attention layers, with every MLP routed through experts.

Rearranged once at load, so the forward reads one layout whatever the checkpoint:
- GDN: one input projection ``gdn.in`` [q | k | v | z | b | a] (qwen3_next stores q, k, v, z
  and b, a interleaved per key head; they are regrouped), ``gdn.conv`` [C, K], ``gdn.A_log``
  and ``gdn.dt_bias`` in float32 whatever the compute dtype.
- Gated attention: q_proj holds per head [query (D) | gate (D)]; the query rows join the fused
  qkv and the gate rows become ``o_gate`` [Hq*D, H].
- Projections keep their format: GGUF blocks are moved by whole rows, and parts of different
  block types stay row parts of one projection.
- RMSNorms that scale by (1 + w) get the 1 added here (the GDN output norm scales by w)
  where the checkpoint stores w (``norm_offset``; GGUF files store 1 + w).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from freetoken.arrays import is_torch
from freetoken.models.config import ModelConfig, QuantWeight

if TYPE_CHECKING:
    from freetoken.models.checkpoint.weights import (Array, LayerWeights, Placement, Weight,
                                                     _Reader)


def plus_one(weight: Array) -> Array:
    """1 + w in the weight's dtype, computed in float32 (a bf16 w then rounds once)."""
    if is_torch(weight):
        return (weight.float() + 1.0).to(weight.dtype)
    return (weight.astype("float32") + 1.0).astype(weight.dtype)


def _rows(weight: Weight, pick: Callable[[Array], Array]) -> Weight:
    """The rows `pick` takes from a matrix (it reshapes and slices the leading axes and keeps
    the last), a float one or a GGUF one (rows of blocks)."""
    if isinstance(weight, QuantWeight):
        data = pick(weight.data)
        data = data.reshape(-1, data.shape[-1])
        return QuantWeight(weight.qtype, data, (data.shape[0], weight.shape[-1]))
    taken = pick(weight)
    return taken.reshape(-1, taken.shape[-1])


def _join(parts: list[Weight]) -> list[Weight]:
    """The parts as one matrix where they concatenate, else as row parts (make_linear)."""
    from freetoken.models.checkpoint.weights import _fuse_rows

    return _fuse_rows(parts)


def _norm(read: _Reader, name: str, size: int, offset: bool) -> Array:
    weight = read.required(name, (size,))
    return plus_one(weight) if offset else weight


def gated_attention(read: _Reader, cfg: ModelConfig, p: str) -> LayerWeights:
    h, qs, kvs, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    q_gate = read.required(p + "q", (2 * qs, h))

    def half(which: int) -> Weight:
        return _rows(q_gate, lambda x: x.reshape(cfg.num_heads, 2, d, x.shape[-1])[:, which])

    qkv = _join([half(0), read.required(p + "k", (kvs, h)), read.required(p + "v", (kvs, h))])
    w = {"qkv": qkv, "o_gate": half(1), "o": read.required(p + "o", (h, qs))}
    if cfg.qk_norm == "head":
        w["q_norm"] = _norm(read, p + "q_norm", d, cfg.norm_offset)
        w["k_norm"] = _norm(read, p + "k_norm", d, cfg.norm_offset)
    return w


def _gdn_projection(read: _Reader, cfg: ModelConfig, p: str) -> list[Weight]:
    """[q | k | v | z | b | a] rows of the GDN input projection, joined where the parts allow.

    q, k, v, z come as gdn.qkv + gdn.z, or as gdn.qkvz (qwen3_next's HF files and older GGUF
    ones: per key head [q | k | v | z]); b, a as gdn.b + gdn.a, or as gdn.ba (qwen3_next: per
    key head [b | a])."""
    lin, h = cfg.linear, cfg.hidden_size
    hk, dk, r = lin.num_k_heads, lin.head_k_dim, lin.num_v_heads // lin.num_k_heads
    group_v = lin.value_dim // hk          # the value columns that share one key head

    def per_key_head(weight: Weight, width: int, start: int, stop: int) -> Weight:
        return _rows(weight, lambda x: x.reshape(hk, width, x.shape[-1])[:, start:stop])

    fused = read.src.get(p + "gdn.qkvz")
    if fused is None:
        parts = [read.required(p + "gdn.qkv", (lin.conv_dim, h)),
                 read.required(p + "gdn.z", (lin.value_dim, h))]
    else:
        qkvz = read.check(p + "gdn.qkvz", fused, (lin.conv_dim + lin.value_dim, h))
        width = 2 * dk + 2 * group_v
        bounds = [0, dk, 2 * dk, 2 * dk + group_v, width]
        parts = [per_key_head(qkvz, width, a, b) for a, b in zip(bounds, bounds[1:])]
    ba = read.src.get(p + "gdn.ba")
    if ba is None:
        parts += [read.required(p + "gdn.b", (lin.num_v_heads, h)),
                  read.required(p + "gdn.a", (lin.num_v_heads, h))]
    else:
        ba = read.check(p + "gdn.ba", ba, (2 * lin.num_v_heads, h))
        parts += [per_key_head(ba, 2 * r, 0, r), per_key_head(ba, 2 * r, r, 2 * r)]
    return _join(parts)


def gated_deltanet(read: _Reader, cfg: ModelConfig, p: str) -> LayerWeights:
    lin, h = cfg.linear, cfg.hidden_size
    conv = read.src.get(p + "gdn.conv")     # [C, 1, K] in HF files
    if conv is not None and len(conv.shape) == 3 and conv.shape[1] == 1:
        conv = conv.reshape(conv.shape[0], conv.shape[2])
    def decay_param(part: str) -> Array:
        """float32 on every device: exp(A_log) of a bf16 copy would be off by up to 0.4%."""
        raw = read.src.get(p + part)
        if raw is None or tuple(raw.shape) != (lin.num_v_heads,):
            read.check(p + part, raw, (lin.num_v_heads,))   # raises, naming the tensor
        return read.where.arrays.place(raw, "float32")

    return {"gdn.in": _gdn_projection(read, cfg, p),
            "gdn.conv": read.check(p + "gdn.conv", conv, (lin.conv_dim, lin.conv_kernel)),
            "gdn.A_log": decay_param("gdn.A_log"), "gdn.dt_bias": decay_param("gdn.dt_bias"),
            "gdn.norm": read.required(p + "gdn.norm", (lin.head_v_dim,)),
            "gdn.out": read.required(p + "gdn.out", (h, lin.value_dim))}


def hybrid_layer(read: _Reader, cfg: ModelConfig, i: int) -> LayerWeights:
    """Every weight of layer i of a hybrid model."""
    from freetoken.models.checkpoint.weights import _dense_mlp, _moe_mlp

    p, h = f"layers.{i}.", cfg.hidden_size
    w = gated_deltanet(read, cfg, p) if cfg.is_linear(i) else gated_attention(read, cfg, p)
    w["input_norm"] = _norm(read, p + "input_norm", h, cfg.norm_offset)
    w["post_norm"] = _norm(read, p + "post_norm", h, cfg.norm_offset)
    if cfg.is_sparse(i):
        w.update(_moe_mlp(read, cfg, p))
    else:
        w.update(_dense_mlp(read, p, h, cfg.intermediate_size))
    return w


def mtp_weights(view, cfg: ModelConfig, block: ModelConfig, where: Placement) -> LayerWeights:
    """Every weight of the multi-token-prediction block from an MTP view (HFTensors.mtp,
    gguf_hybrid.MTPBlocks), checked and placed per `where`: ``fc`` [H, 2H] over
    [embedding | hidden], the three norms, and ``layers``: its decoder layers, shaped by
    `block` (ModelConfig.mtp_block), each a gated full-attention layer with the target's MLP
    kind, read as the target's layers are."""
    from freetoken.models.checkpoint.weights import _Reader

    read, h = _Reader(view, where, cfg.architecture), cfg.hidden_size
    w = {"fc": read.required("mtp.fc", (h, 2 * h))}
    for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[part] = _norm(read, "mtp." + part, h, cfg.norm_offset)
    w["layers"] = [hybrid_layer(read, block, k) for k in range(block.num_layers)]
    return w
