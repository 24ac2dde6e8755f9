"""Layer weights of the hybrid models (Qwen3-Next, Qwen3.5/3.6): Gated DeltaNet layers and
gated full-attention layers, with every MLP routed through experts.

Rearranged once at load, so the forward reads one layout whatever the checkpoint:
- GDN: one input projection ``gdn.in`` [q | k | v | z | b | a] (qwen3_next stores q, k, v, z
  and b, a interleaved per key head; they are regrouped), ``gdn.conv`` [C, K], ``gdn.A_log``
  and ``gdn.dt_bias`` in float32 whatever the compute dtype.
- Gated attention: q_proj holds per head [query (D) | gate (D)]; the query rows join the fused
  qkv and the gate rows become ``o_gate`` [Hq*D, H].
- RMSNorms that scale by (1 + w) get the 1 added here (the GDN output norm scales by w).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freetoken.arrays import is_torch
from freetoken.models.config import ModelConfig

if TYPE_CHECKING:
    from freetoken.models.checkpoint.weights import Array, LayerWeights, _Reader


def plus_one(weight: Array) -> Array:
    """1 + w in the weight's dtype, computed in float32 (a bf16 w then rounds once)."""
    if is_torch(weight):
        return (weight.float() + 1.0).to(weight.dtype)
    return (weight.astype("float32") + 1.0).astype(weight.dtype)


def _cat(parts: list[Array]) -> Array:
    from freetoken.models.checkpoint.weights import _concat

    return _concat([p.reshape(-1, p.shape[-1]) for p in parts])


def _norm(read: _Reader, name: str, size: int, offset: bool) -> Array:
    weight = read.required(name, (size,))
    return plus_one(weight) if offset else weight


def gated_attention(read: _Reader, cfg: ModelConfig, p: str) -> LayerWeights:
    h, qs, kvs, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    q_gate = read.required(p + "q", (2 * qs, h)).reshape(cfg.num_heads, 2, d, h)
    qkv = _cat([q_gate[:, 0], read.required(p + "k", (kvs, h)), read.required(p + "v", (kvs, h))])
    w = {"qkv": [qkv], "o_gate": _cat([q_gate[:, 1]]), "o": read.required(p + "o", (h, qs))}
    if cfg.qk_norm == "head":
        w["q_norm"] = _norm(read, p + "q_norm", d, cfg.norm_offset)
        w["k_norm"] = _norm(read, p + "k_norm", d, cfg.norm_offset)
    return w


def _gdn_projection(read: _Reader, cfg: ModelConfig, p: str) -> Array:
    """[q | k | v | z | b | a] rows of the GDN input projection, as one matrix."""
    lin, h = cfg.linear, cfg.hidden_size
    fused = read.src.get(p + "gdn.qkvz")
    if fused is None:
        return _cat([read.required(p + "gdn.qkv", (lin.conv_dim, h)),
                     read.required(p + "gdn.z", (lin.value_dim, h)),
                     read.required(p + "gdn.b", (lin.num_v_heads, h)),
                     read.required(p + "gdn.a", (lin.num_v_heads, h))])
    hk, dk = lin.num_k_heads, lin.head_k_dim
    group_v = lin.value_dim // hk          # the value columns that share one key head
    r = lin.num_v_heads // hk
    qkvz = read.check(p + "gdn.qkvz", fused, (lin.conv_dim + lin.value_dim, h))
    qkvz = qkvz.reshape(hk, 2 * dk + 2 * group_v, h)
    ba = read.required(p + "gdn.ba", (2 * lin.num_v_heads, h)).reshape(hk, 2 * r, h)
    bounds = [0, dk, 2 * dk, 2 * dk + group_v, 2 * dk + 2 * group_v]
    q, k, v, z = (qkvz[:, a:b] for a, b in zip(bounds, bounds[1:]))
    return _cat([q, k, v, z, ba[:, :r], ba[:, r:]])


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
