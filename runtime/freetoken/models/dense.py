"""The dense decoder forward shared by llama, qwen2, qwen3 and mistral.

Per layer: qkv projection (+ bias), optional per-head q/k RMSNorm, rope, KV store, paged
attention, o projection, fused residual-add + norm, gate/up projection, SiLU-and-mul, down
projection, fused residual-add + the next norm. Every step writes into preallocated buffers.
"""

from __future__ import annotations

import dataclasses

from freetoken.arrays import Device, HostArrays, TorchArrays
from freetoken.kernel import ops
from freetoken.models.batch import Array, ForwardBatch, KVCache
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.linear import make_linear
from freetoken.models.rope import cos_sin_cache
from freetoken.models.weights import DecoderWeights, LayerWeights
from freetoken.models.workspace import Workspace, WorkViews


class _Kernels:
    """The ops the forward calls, bound once for the device (no look-ups in the hot loop)."""

    def __init__(self, arrays: HostArrays | TorchArrays, quantized_embedding: bool):
        device = arrays.device
        self.rms_norm = ops.bind("rms_norm", device)
        self.fused_add_rms_norm = ops.bind("fused_add_rms_norm", device)
        self.rotary_embedding = ops.bind("rotary_embedding", device)
        self.store_kv = ops.bind("store_kv", device)
        self.paged_attention = ops.bind("paged_attention", device)
        self.silu_and_mul = ops.bind("silu_and_mul", device)
        self.embed = ops.bind("dequantize_rows" if quantized_embedding else "embedding", device)
        self.gather_rows = ops.bind("embedding", device)
        # CUDA decode splits long contexts across blocks through this scratch (4 MiB covers
        # every decode batch); the CPU kernel takes none.
        self.attn_extra = (() if device.is_cpu else (arrays.empty(1 << 20, "float32"),))
        self.arg = arrays.kernel_arg


class _DecoderLayer:
    def __init__(self, w: LayerWeights, next_norm: Array, cfg: ModelConfig,
                 rope: Array, kernels: _Kernels):
        self.ops = kernels
        arg = kernels.arg
        self.post_norm, self.next_norm = arg(w.post_norm), arg(next_norm)
        self.q_norm = None if w.q_norm is None else arg(w.q_norm)
        self.k_norm = None if w.k_norm is None else arg(w.k_norm)
        self.qkv = make_linear(w.qkv, w.qkv_bias)
        self.o = make_linear(w.o)
        self.gate_up = make_linear(w.gate_up)
        self.down = make_linear(w.down)
        self.rope = rope
        self.eps = cfg.rms_norm_eps
        self.head_dim, self.is_neox = cfg.head_dim, cfg.rope_is_neox
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window

    def forward(self, w: WorkViews, batch: ForwardBatch, k_cache: Array, v_cache: Array,
                block_size: int) -> None:
        """hidden holds this layer's normed input; on return, the next layer's normed input."""
        ops = self.ops
        self.qkv(w.qkv, w.hidden)
        w.split_qkv()
        if self.q_norm is not None:      # in place: each row is read before it is written
            ops.rms_norm(w.q_heads, w.q_heads, self.q_norm, self.eps)
            ops.rms_norm(w.k_heads, w.k_heads, self.k_norm, self.eps)
        ops.rotary_embedding(batch.positions, w.q, w.k, self.rope, self.head_dim, self.is_neox)
        ops.store_kv(w.k3, w.v3, k_cache, v_cache, batch.slot_mapping)
        ops.paged_attention(w.attn3, w.q3, k_cache, v_cache, batch.block_tables,
                            batch.seq_lens, batch.query_start_loc, block_size, self.scale,
                            self.window, *ops.attn_extra)
        self.o(w.hidden, w.attn)
        ops.fused_add_rms_norm(w.hidden, w.residual, self.post_norm, self.eps)
        self.gate_up(w.gate_up, w.hidden)
        ops.silu_and_mul(w.act, w.gate_up)
        self.down(w.hidden, w.act)
        ops.fused_add_rms_norm(w.hidden, w.residual, self.next_norm, self.eps)


class DenseDecoder:
    """A dense decoder-only transformer over the paged KV cache.

    Attributes: ``config``, ``arrays`` (how its buffers are made), ``device``, ``dtype``
    (activations and KV cache: float32, bfloat16 or float16).
    """

    def __init__(self, config: ModelConfig, weights: DecoderWeights,
                 arrays: HostArrays | TorchArrays, dtype: str):
        self.config, self.arrays, self.dtype = config, arrays, dtype
        self.device: Device = arrays.device
        quantized_embedding = isinstance(weights.embed, QuantWeight)
        self._k = kernels = _Kernels(arrays, quantized_embedding)
        self._rope = kernels.arg(arrays.place(cos_sin_cache(config, weights.rope_freq_factors),
                                              "float32"))
        norms = [lw.input_norm for lw in weights.layers[1:]] + [weights.final_norm]
        self.layers = [_DecoderLayer(lw, nxt, config, self._rope, kernels)
                       for lw, nxt in zip(weights.layers, norms)]
        self._first_norm = kernels.arg(weights.layers[0].input_norm)
        self._embed = weights.embed
        self._embed_arg = kernels.arg(weights.embed.data if quantized_embedding else weights.embed)
        self._kv_args: tuple = (None, [], [])
        self._lm_head = make_linear(weights.lm_head)
        self._head_is_f32 = isinstance(weights.lm_head, QuantWeight) or dtype == "float32"
        self._workspace = Workspace(config, dtype, arrays)
        if self.device.is_cpu:
            _apply_kernel_threads()

    def reserve(self, max_tokens: int) -> None:
        """Preallocate work buffers for steps of up to `max_tokens` tokens."""
        self._workspace.reserve(max_tokens)

    def _embed_into(self, out, ids) -> None:
        if isinstance(self._embed, QuantWeight):
            self._k.embed(out, ids, self._embed_arg, self._embed.qtype)
        else:
            self._k.embed(out, ids, self._embed_arg)

    def _kv_caches(self, kv: KVCache) -> tuple[list, list]:
        """The pools as kernel arguments, converted once per KV cache."""
        if self._kv_args[0] is not kv:
            arg = self._k.arg
            self._kv_args = (kv, [arg(k) for k in kv.k], [arg(v) for v in kv.v])
        return self._kv_args[1], self._kv_args[2]

    def forward(self, batch: ForwardBatch, kv: KVCache) -> Array:
        """float32 logits [B, vocab] for the rows batch.logits_indices of this step."""
        arg = self._k.arg
        batch = dataclasses.replace(batch, **{f.name: arg(getattr(batch, f.name))
                                              for f in dataclasses.fields(batch)
                                              if f.name != "max_query_len"})
        w = self._workspace.views(batch.num_tokens)
        self._embed_into(w.residual, batch.input_ids)
        self._k.rms_norm(w.hidden, w.residual, self._first_norm, self.config.rms_norm_eps)
        block_size = kv.block_size
        for layer, k_cache, v_cache in zip(self.layers, *self._kv_caches(kv)):
            layer.forward(w, batch, k_cache, v_cache, block_size)
        rows = w.hidden
        if batch.num_tokens != batch.num_seqs:  # else every token is its sequence's last
            rows = arg(self.arrays.empty((batch.num_seqs, self.config.hidden_size), self.dtype))
            self._k.gather_rows(rows, batch.logits_indices, w.hidden)
        logits = self.arrays.empty((batch.num_seqs, self.config.vocab_size), "float32")
        if self._head_is_f32:
            self._lm_head(arg(logits), rows)
            return logits
        low = self.arrays.empty(logits.shape, self.dtype)
        self._lm_head(low, rows)
        logits[...] = low
        return logits


def _apply_kernel_threads() -> None:
    """Size the CPU kernels' shared thread pool from FREETOKEN_NUM_THREADS (0 = every core)."""
    from freetoken import env

    threads = env.read().num_threads
    if threads > 0:
        ops.bind("set_num_threads", "cpu")(threads)
