"""The dense decoder forward shared by llama, qwen2, qwen3 and mistral.

Per layer: qkv projection (+ bias), optional per-head q/k RMSNorm, rope, KV store, paged
attention, o projection, fused residual-add + norm, gate/up projection, SiLU-and-mul, down
projection, fused residual-add + the next norm. Every step writes into preallocated buffers.
"""

from __future__ import annotations

import torch

from freetoken.models.batch import ForwardBatch, KVCache
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.kernels import bind_op
from freetoken.models.linear import QuantLinear, make_linear
from freetoken.models.rope import cos_sin_cache
from freetoken.models.weights import DecoderWeights, LayerWeights
from freetoken.models.workspace import Workspace, WorkViews


class _Kernels:
    """The ops the forward calls, bound once for the device (no look-ups in the hot loop)."""

    def __init__(self, device: torch.device, quantized_embedding: bool):
        for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "store_kv",
                     "paged_attention", "silu_and_mul"):
            setattr(self, name, bind_op(name, device))
        embed_op = "dequantize_rows" if quantized_embedding else "embedding"
        self.embed = bind_op(embed_op, device)
        # CUDA decode splits long contexts across blocks through this scratch (4 MiB covers
        # every decode batch); the CPU kernel takes none.
        self.attn_extra = ((torch.empty(1 << 20, dtype=torch.float32, device=device),)
                           if device.type == "cuda" else ())


class _DecoderLayer:
    def __init__(self, w: LayerWeights, next_norm: torch.Tensor, cfg: ModelConfig,
                 rope: torch.Tensor, kernels: _Kernels):
        self.ops = kernels
        self.input_norm, self.post_norm, self.next_norm = w.input_norm, w.post_norm, next_norm
        self.q_norm, self.k_norm = w.q_norm, w.k_norm
        self.qkv = make_linear(w.qkv, w.qkv_bias)
        self.o = make_linear(w.o)
        self.gate_up = make_linear(w.gate_up)
        self.down = make_linear(w.down)
        self.rope = rope
        self.eps = cfg.rms_norm_eps
        self.head_dim, self.is_neox = cfg.head_dim, cfg.rope_is_neox
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window

    def forward(self, w: WorkViews, batch: ForwardBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor, block_size: int) -> None:
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

    Attributes: ``config``, ``device``, ``dtype`` (activations and KV cache).
    """

    def __init__(self, config: ModelConfig, weights: DecoderWeights, device: torch.device,
                 dtype: torch.dtype):
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        quantized_embedding = isinstance(weights.embed, QuantWeight)
        self._k = kernels = _Kernels(self.device, quantized_embedding)
        self._rope = cos_sin_cache(config, self.device, weights.rope_freq_factors)
        norms = [lw.input_norm for lw in weights.layers[1:]] + [weights.final_norm]
        self.layers = [_DecoderLayer(lw, nxt, config, self._rope, kernels)
                       for lw, nxt in zip(weights.layers, norms)]
        self._first_norm = weights.layers[0].input_norm
        self._embed = weights.embed
        self._lm_head = make_linear(weights.lm_head)
        self._head_is_f32 = isinstance(weights.lm_head, QuantWeight) or dtype == torch.float32
        self._workspace = Workspace(config, dtype, self.device)
        if self.device.type == "cpu":
            _apply_kernel_threads()

    @property
    def matmuls_in_kernels(self) -> bool:
        """True when every projection runs in the quantized kernels (none through torch.mm),
        so torch's own CPU threads only serve small bookkeeping ops."""
        linears = [self._lm_head] + [lin for layer in self.layers
                                     for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return all(isinstance(lin, QuantLinear) for lin in linears)

    def reserve(self, max_tokens: int) -> None:
        """Preallocate work buffers for steps of up to `max_tokens` tokens."""
        self._workspace.reserve(max_tokens)

    def _embed_into(self, out: torch.Tensor, ids: torch.Tensor) -> None:
        if isinstance(self._embed, QuantWeight):
            self._k.embed(out, ids, self._embed.data, self._embed.qtype)
        else:
            self._k.embed(out, ids, self._embed)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """float32 logits [B, vocab] for the rows batch.logits_indices of this step."""
        w = self._workspace.views(batch.num_tokens)
        self._embed_into(w.residual, batch.input_ids)
        self._k.rms_norm(w.hidden, w.residual, self._first_norm, self.config.rms_norm_eps)
        block_size = kv.block_size
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v):
            layer.forward(w, batch, k_cache, v_cache, block_size)
        # T == B: every token is its sequence's last (pure decode), so no gather is needed.
        rows = (w.hidden if batch.num_tokens == batch.num_seqs
                else w.hidden.index_select(0, batch.logits_indices))
        logits = torch.empty((rows.shape[0], self.config.vocab_size), dtype=torch.float32,
                             device=self.device)
        if self._head_is_f32:
            self._lm_head(logits, rows)
            return logits
        low = torch.empty(logits.shape, dtype=self.dtype, device=self.device)
        self._lm_head(low, rows)
        return logits.copy_(low)


def _apply_kernel_threads() -> None:
    """Size the CPU kernels' shared thread pool from FREETOKEN_NUM_THREADS (0 = every core)."""
    from freetoken import env

    threads = env.read().num_threads
    if threads > 0:
        from freetoken.kernel.loader import get_function

        get_function("quant_gemm", "set_num_threads", "cpu")(threads)
