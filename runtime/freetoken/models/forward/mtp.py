"""The multi-token-prediction (MTP) block of Qwen3-Next and Qwen3.5/3.6 checkpoints: a one-layer
draft model that shares the target's embedding and LM head.

For a token at position t whose target hidden state is h_t and whose next token is x_{t+1}:

    z = fc([pre_fc_norm_embedding(embed(x_{t+1})) | pre_fc_norm_hidden(h_t)])   # [H, 2H]
    y = mtp.norm(decoder_layer(z, position t))     # gated full attention + the target's MLP
    logits(x_{t+2}) = lm_head(y)

as vLLM's qwen3_next_mtp.py / qwen3_5_mtp.py and SGLang's qwen3_next_mtp.py compute it: the
embedding comes first in the concatenation, h_t is the target's final-normed hidden state (what
its LM head reads: ``Decoder.last_hidden``), the layer runs at the position of h_t with its own
K/V of the earlier positions, and y (after mtp.norm) is both what the head reads and the hidden
state of the next draft step, which applies the block again to its own output.

The layer is the decoder's own (decoder.DecoderLayer: attention.py, mlp.py and the kernels), so
the block runs wherever the target does, over an ``MTPBlock.create_kv_cache`` pool addressed
like the target's pool (same pages, same slot of a position).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from freetoken.arrays import array_view
from freetoken.models.batch import Array, ForwardBatch, KVCache
from freetoken.models.checkpoint.weights import LayerWeights, Placement
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.forward import moe_decode
from freetoken.models.forward.decoder import DecoderLayer, Kernels
from freetoken.models.forward.linear import make_linear
from freetoken.models.forward.workspace import Workspace

if TYPE_CHECKING:
    from freetoken.models.forward.decoder import Decoder


class MTPBlock:
    """The MTP block of a loaded target model (``Decoder.mtp``).

    Attributes: ``config`` (the block's layers as a config: ModelConfig.mtp_block; its
    ``kv_layers`` are the pool's layers), ``num_layers``, ``target`` (the Decoder whose embedding,
    LM head, rope table and kernels it shares), ``last_hidden`` (after a forward: the output
    hidden state of every token of the step [T, hidden], a kernel argument).
    """

    def __init__(self, target: Decoder, weights: LayerWeights, config: ModelConfig):
        self.target, self.config = target, config
        self.arrays, self.dtype = target.arrays, target.dtype
        quantized = any(isinstance(lw.get("experts.gate_up"), QuantWeight)
                        for lw in weights["layers"])
        # The target's kernels may lack the quantized-experts op this block's experts need
        self._k = kernels = Kernels(self.arrays, config, False, quantized)
        kernels.attn_extra = target.kernels.attn_extra
        arg = kernels.arg
        self._fc = make_linear(weights["fc"])
        self._norm_embedding = arg(weights["pre_fc_norm_embedding"])
        self._norm_hidden = arg(weights["pre_fc_norm_hidden"])
        self.layers = [DecoderLayer(lw, weights["norm"], config, k, target.rope, kernels,
                                    self.arrays) for k, lw in enumerate(weights["layers"])]
        self._input_norms = [arg(lw["input_norm"]) for lw in weights["layers"]]
        moe_decode.attach(self.layers, weights["layers"], config, self.dtype, self.arrays)
        self._workspace = Workspace(config, self.dtype, self.arrays)
        self._joined: Array | None = None          # [capacity, 2H]: [embedding | hidden] normed
        self._joined_views: dict[int, tuple] = {}
        self._kv_args: tuple = (None, [], [])
        self.last_hidden = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def create_kv_cache(self, num_blocks: int, block_size: int,
                        dtype: str | None = None) -> KVCache:
        """The block's own K/V pool: one attention layer per MTP layer, [S, Hk, D] each with
        S = num_blocks * block_size slots. Allocate it with the target pool's num_blocks and
        block_size and address it with the target's block tables: position p of a sequence
        then sits in the same slot in both pools."""
        return KVCache(self.config, num_blocks, block_size, dtype or self.dtype, self.arrays)

    def kv_bytes_per_token(self, dtype: str | None = None) -> int:
        """Bytes of one token in ``create_kv_cache``'s pool (K and V of every MTP layer)."""
        return KVCache.bytes_per_token(self.config, dtype or self.dtype)

    def reserve(self, max_tokens: int) -> None:
        """Preallocate work buffers for steps of up to `max_tokens` tokens (CUDA graphs)."""
        self._workspace.reserve(max_tokens)
        self._joined_rows(max_tokens)

    def _joined_rows(self, tokens: int) -> tuple:
        """Kernel arguments over the first `tokens` rows of the joined buffer: (all, the
        embedding half, the hidden half)."""
        views = self._joined_views.get(tokens)
        if views is not None:
            return views
        h = self.config.hidden_size
        if self._joined is None or self._joined.shape[0] < tokens:
            capacity = max(tokens, 2 * (0 if self._joined is None else self._joined.shape[0]))
            self._joined = self.arrays.empty((capacity, 2 * h), self.dtype)
            self._joined_views.clear()
        rows = self._joined[:tokens]
        arg = self._k.arg
        views = (arg(rows), arg(rows[:, :h]), arg(rows[:, h:]))
        self._joined_views[tokens] = views
        return views

    def _kv_caches(self, kv: KVCache) -> tuple[list, list]:
        if self._kv_args[0] is not kv:
            arg = self._k.kv_arg
            self._kv_args = (kv, [arg(k) for k in kv.k], [arg(v) for v in kv.v])
        return self._kv_args[1], self._kv_args[2]

    def forward(self, batch: ForwardBatch, hidden: Array, kv: KVCache,
                step: int = 0) -> tuple[Array, Array]:
        """One draft step over the T tokens of `batch`.

        Args:
            batch: the step as the target's forward takes it, on the model device: input_ids
                [T] the next tokens x_{t+1}; positions [T] the positions t of the hidden
                states (the target's positions); slot_mapping [T], block_tables, seq_lens,
                query_start_loc address `kv` as the target's pool is addressed (seq_lens count
                the tokens this pool holds for the sequence after the step); logits_indices
                [R] the rows whose logits and hidden states are returned.
            hidden: [T, hidden] in the model dtype, h_t of each token: the target's
                ``last_hidden`` rows (prefill, or the verify step), or this block's previous
                output (recursive drafting). Read before anything is written, so it may be a
                view of this block's own previous output.
            kv: the block's pool (``create_kv_cache``); K and V of the T tokens are written.
            step: which MTP layer runs (step % num_layers: every checkpoint so far has one).
        Returns:
            (float32 logits [R, vocab] of the tokens after x_{t+1}, the output hidden states
            [R, hidden] of those rows for the next draft step), arrays of the model's device;
            the hidden rows may view a work buffer, valid until the next forward.
        """
        k, arg, eps = self._k, self._k.arg, self.config.rms_norm_eps
        batch = dataclasses.replace(batch, **{f.name: arg(getattr(batch, f.name))
                                              for f in dataclasses.fields(batch)
                                              if f.name not in ("max_query_len", "multimodal")
                                              and getattr(batch, f.name) is not None})
        if isinstance(hidden, np.ndarray):
            hidden = arg(hidden)
        t = batch.num_tokens
        w = self._workspace.views(t)
        joined, embedding_half, hidden_half = self._joined_rows(t)
        k.rms_norm(hidden_half, hidden, self._norm_hidden, eps)
        self.target.embed_into(w.residual, batch.input_ids)
        k.rms_norm(embedding_half, w.residual, self._norm_embedding, eps)
        self._fc(w.residual, joined)                   # z: the layer's residual stream
        index = step % len(self.layers)
        layer = self.layers[index]
        layer.attn.rope = self.target.rope             # the target may have grown its table
        k.rms_norm(w.hidden, w.residual, self._input_norms[index], eps)
        k_caches, v_caches = self._kv_caches(kv)
        x = layer.forward(w.hidden, w, batch, k_caches[index], v_caches[index], kv.block_size)
        self.last_hidden = x                           # mtp.norm(z + attention + MLP)
        rows = x
        num_rows = batch.logits_indices.shape[0]
        if t != num_rows:
            rows = arg(self.arrays.empty((num_rows, self.config.hidden_size), self.dtype))
            k.gather_rows(rows, batch.logits_indices, x)
        return self.target.logits(rows), array_view(rows)


def build_mtp(tensors, config: ModelConfig, placement: Placement,
              target: Decoder) -> MTPBlock | None:
    """The MTP block of a checkpoint for `target`, or None when it has none (or the source
    offers no ``mtp()`` view, or the architecture has no MTP block). Its weights are placed
    per `placement`, routed experts beside the rest (never offloaded). Raises
    MissingTensorError / ModelFormatError naming the tensor at fault."""
    from freetoken.models.checkpoint.hybrid_weights import mtp_weights

    mtp = getattr(tensors, "mtp", None)
    view = mtp() if mtp is not None and config.linear is not None else None
    if view is None:
        return None
    # routed experts where the block has a router (as the target's MoE layers), else dense
    block = config.mtp_block(config.moe is not None
                             and view.stored("layers.0.router") is not None)
    where = dataclasses.replace(placement, experts=None)
    return MTPBlock(target, mtp_weights(view, config, block, where), block)
