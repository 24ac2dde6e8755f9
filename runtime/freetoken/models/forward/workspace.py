"""Activation buffers of the forward: allocated for the largest step seen (or reserved),
grown on demand, and sliced into per-token-count views that are cached for reuse. CUDA graphs
hold their pointers, so the engine reserves the largest step before capturing."""

from __future__ import annotations

from typing import Any

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays
from freetoken.models.config import ModelConfig

_CACHED_VIEW_SETS = 64     # distinct step sizes whose views are kept (decode batches repeat)


class WorkViews:
    """Views over the workspace for one step of T tokens.

    hidden/residual [T, hidden]; qkv [T, q+2kv] is the fused projection output and q [T, Hq*D],
    k/v [T, Hk*D] are views of its columns (rows strided by q+2kv, which the kernels accept);
    with a per-head q/k norm and T > 1, q and k are contiguous copies instead (made by
    ``split_qkv``) so that q_heads/k_heads [T*H, D] can view them. q3/k3/v3 and attn3 are the
    same memory as [T, H, D]; gate_up [T, 2I]; act [T, I]; attn [T, Hq*D]. qkv_cols (q, k, v)
    and q3_cols are always the column views (the fused decode step norms q/k in place there).
    MoE models add alt [T, hidden] (a layer whose MLP cannot write in place writes there, and
    the next layer reads it), router_logits [T, E], topk_weights f32 / topk_ids int32 [T, K],
    moe_workspace (uint8 scratch of the experts kernel) and, with a shared expert,
    shared_gate_up [T, 2Is], shared_act [T, Is], shared_out [T, hidden], shared_gate [T, 1].
    Hybrid models add attn_gate [T, Hq*D] (the attention output gate) and, for their GDN
    layers, gdn_in [T, projection] (column views gdn_qkv, gdn_z, gdn_ba: the conv's input, the
    output gate, the decay inputs), gdn_conv [T, conv channels], gdn_core [T, Hv*dv] (and,
    where the out projection takes value heads tiled, gdn_grouped and tile_value_heads()).
    Every public field is a kernel argument (``arrays.kernel_arg``); ``split_qkv`` copies
    between the arrays it kept aside.
    """

    def __init__(self, bufs: dict[str, Any], cfg: ModelConfig, t: int, copy_qk: bool,
                 arrays: HostArrays | TorchArrays):
        qs, kvs, d = cfg.q_size, cfg.kv_size, cfg.head_dim
        for name, buf in bufs.items():
            if name not in ("q", "k"):
                setattr(self, name, buf if buf.ndim == 1 else buf[:t])
        self.attn3 = view_as(self.attn, (t, cfg.num_heads, d))
        self.q = self.qkv[:, :qs]
        self.k = self.qkv[:, qs:qs + kvs]
        self.v = self.qkv[:, qs + kvs:]
        cols = (self.q, self.k, self.v)  # column views, even where q/k get copies below
        self.q3_cols = view_as(self.q, (t, cfg.num_heads, d))
        self.split_qkv = _nothing
        if copy_qk:
            self._sources = (self.q, self.k)
            self.q, self.k = bufs["q"][:t], bufs["k"][:t]
            self.split_qkv = self._copy_qk
        self.q3 = view_as(self.q, (t, cfg.num_heads, d))
        self.k3 = view_as(self.k, (t, cfg.num_kv_heads, d))
        self.v3 = view_as(self.v, (t, cfg.num_kv_heads, d))
        if copy_qk or t == 1:
            self.q_heads = view_as(self.q, (t * cfg.num_heads, d))
            self.k_heads = view_as(self.k, (t * cfg.num_kv_heads, d))
        self._copies = [(self.q, self._sources[0]), (self.k, self._sources[1])] if copy_qk else []
        if cfg.linear is not None:
            c, vd = cfg.linear.conv_dim, cfg.linear.value_dim
            self.gdn_qkv = self.gdn_in[:, :c]
            self.gdn_z = self.gdn_in[:, c:c + vd]
            self.gdn_ba = self.gdn_in[:, c + vd:]
            if cfg.linear.tiled_value_heads:
                self._tile_views(cfg, t)
        for name, value in list(vars(self).items()):
            if name[0] != "_" and not callable(value):
                setattr(self, name, arrays.kernel_arg(value))
        self.qkv_cols = tuple(arrays.kernel_arg(c) for c in cols)

    def other(self, x):
        """The [T, hidden] buffer that is not `x` (hidden or alt)."""
        return self.alt if x is self.hidden else self.hidden

    def _copy_qk(self) -> None:
        for dst, src in self._copies:
            dst[...] = src

    def _tile_views(self, cfg: ModelConfig, t: int) -> None:
        """gdn_grouped [T, Hv*dv]: the GDN output in grouped head order, in gdn_conv's columns
        (free once the recurrence has read them); tile_value_heads() copies it into gdn_core
        with the heads tiled: gdn_core[:, i, g] = gdn_grouped[:, g, i] over [T, r, Hk, dv]."""
        lin = cfg.linear
        hk, r, dv = lin.num_k_heads, lin.num_v_heads // lin.num_k_heads, lin.head_v_dim
        self.gdn_grouped = self.gdn_conv[:, :lin.value_dim]
        # views, never copies: the cached views must read the buffers as each step leaves them
        self._tiling = (view_as(self.gdn_core, (t, r, hk, dv)),
                        view_as(self.gdn_grouped, (t, hk, r, dv)).swapaxes(1, 2))
        self.tile_value_heads = self._tile

    def _tile(self) -> None:
        dst, src = self._tiling
        dst[...] = src


def view_as(array, shape: tuple[int, ...]):
    """`array` with a new shape, always a view (kernels write through it), never a copy."""
    if isinstance(array, np.ndarray):
        return np.reshape(array, shape, copy=False)
    return array.view(shape)


def _nothing() -> None:
    return None


class Workspace:
    """Owns the buffers; ``views(t)`` is the only per-step call (one dict look-up)."""

    def __init__(self, cfg: ModelConfig, dtype: str, arrays: HostArrays | TorchArrays):
        self.cfg, self.dtype, self.arrays = cfg, dtype, arrays
        # The per-head q/k norm needs flat [T*H, D] rows: contiguous copies unless T == 1 (a norm
        # over the whole q and k projections reads their strided rows in place).
        self.copy_qk = cfg.qk_norm == "head"
        self.capacity = 0
        self._bufs: dict[str, Any] = {}
        self._views: dict[int, WorkViews] = {}

    def reserve(self, tokens: int) -> None:
        """Make room for steps of `tokens` tokens (buffers only grow)."""
        if tokens <= self.capacity:
            return
        c, n = self.cfg, max(tokens, 2 * self.capacity)
        widths = {"hidden": c.hidden_size, "residual": c.hidden_size,
                  "qkv": c.q_size + 2 * c.kv_size, "attn": c.q_size,
                  "gate_up": 2 * c.intermediate_size, "act": c.intermediate_size}
        if self.copy_qk:
            widths.update(q=c.q_size, k=c.kv_size)
        if c.attn_output_gate:
            widths.update(attn_gate=c.q_size)
        if c.linear is not None:   # GDN: input projection, conv output, recurrence output
            widths.update(gdn_in=c.linear.projection_size, gdn_conv=c.linear.conv_dim,
                          gdn_core=c.linear.value_dim)
        self._bufs = {name: self.arrays.empty((n, width), self.dtype)
                      for name, width in widths.items()}
        if c.moe is not None:
            self._bufs.update(self._moe_buffers(n))
        self.capacity = n
        self._views.clear()

    def _moe_buffers(self, n: int) -> dict[str, Any]:
        from freetoken.kernel.ops import moe_workspace_bytes

        moe, h, empty = self.cfg.moe, self.cfg.hidden_size, self.arrays.empty
        scratch = moe_workspace_bytes(n, moe.top_k, moe.num_experts, moe.intermediate_size,
                                      self.dtype)
        bufs = {"alt": empty((n, h), self.dtype),
                "router_logits": empty((n, moe.num_experts), self.dtype),
                "topk_weights": empty((n, moe.top_k), "float32"),
                "topk_ids": empty((n, moe.top_k), "int32"),
                "moe_workspace": empty((scratch,), "uint8")}
        shared = moe.shared_intermediate_size
        if shared:
            bufs.update(shared_gate_up=empty((n, 2 * shared), self.dtype),
                        shared_act=empty((n, shared), self.dtype),
                        shared_out=empty((n, h), self.dtype),
                        shared_gate=empty((n, 1), self.dtype))
        return bufs

    def views(self, tokens: int) -> WorkViews:
        views = self._views.get(tokens)
        if views is None:
            self.reserve(tokens)
            views = WorkViews(self._bufs, self.cfg, tokens, self.copy_qk and tokens > 1,
                              self.arrays)
            if len(self._views) < _CACHED_VIEW_SETS:
                self._views[tokens] = views
        return views
