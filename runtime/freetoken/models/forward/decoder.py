"""The decoder forward shared by every architecture: embedding, layers, final norm, LM head.

A layer is an attention block (attention.py) and an MLP block (mlp.py: dense, or routed
experts), chosen per layer from the config. Every step writes into preallocated buffers; an
MLP may return its output in the workspace's other hidden buffer, which the next layer reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from freetoken.arrays import Device, HostArrays, TorchArrays, array_view, is_torch
from freetoken.kernel import ops
from freetoken.models.batch import Array, ForwardBatch, Fp8Pool, KVCache
from freetoken.models.checkpoint.weights import DecoderWeights, LayerWeights
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.forward import dequant, fused_decode, moe_decode
from freetoken.models.forward.attention import AttentionBlock
from freetoken.models.forward.dequant import DequantScratch
from freetoken.models.forward.deepstack import add_deepstack, deepstack_levels, write_embeds
from freetoken.models.forward.gdn import GatedDeltaNetBlock
from freetoken.models.forward.linear import make_linear
from freetoken.models.forward.mlp import DenseMLP, MoEMLP
from freetoken.models.forward.rope import cos_sin_cache
from freetoken.models.forward.workspace import Workspace, WorkViews

_OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "store_kv", "paged_attention",
        "silu_and_mul")
_MOE_OPS = ("moe_topk_softmax", "moe_experts")
_GDN_OPS = ("gdn_conv1d", "gdn_recurrence", "rms_norm_gated")


class Kernels:
    """The ops the forward calls, bound once for the device (no look-ups in the hot loop)."""

    def __init__(self, arrays: HostArrays | TorchArrays, cfg: ModelConfig,
                 quantized_embedding: bool, quantized_experts: bool):
        device = arrays.device
        names = _OPS + (_MOE_OPS if cfg.moe is not None else ())
        quant_experts = "moe_experts_quant" if device.is_cpu else "moe_experts_gguf"
        names += (quant_experts,) if quantized_experts else ()
        names += _GDN_OPS if cfg.linear is not None else ()
        names += ("gelu_tanh_and_mul",) if cfg.activation == "gelu_tanh" else ()
        for name in names:
            setattr(self, name, ops.bind(name, device))
        quant_embed = "dequantize_rows" if device.is_cpu else "gguf_dequantize_rows"
        embed_op = quant_embed if quantized_embedding else "embedding"
        self.embed = ops.bind(embed_op, device)
        self.gather_rows = ops.bind("embedding", device)
        # CUDA decode splits long contexts across blocks through this scratch (4 MiB covers
        # every decode batch); the CPU kernel takes none.
        self.attn_extra = (() if device.is_cpu else (arrays.empty(1 << 20, "float32"),))
        self.arg = arrays.kernel_arg
        fp8_kv_ops(self, device)

    def kv_arg(self, pool: Array) -> Array:
        """A K or V pool as a kernel argument (both arrays of an FP8 pool)."""
        return pool.map(self.arg) if isinstance(pool, Fp8Pool) else self.arg(pool)


def fp8_kv_ops(kernels: Kernels, device) -> None:
    """store_kv and paged_attention that take an FP8 pool (models/batch.py Fp8Pool) as well:
    its codes and scales go to the _fp8 kernels, bound on first use."""
    store, attend, fp8 = kernels.store_kv, kernels.paged_attention, {}

    def bound(name: str):
        if name not in fp8:
            fp8[name] = ops.bind(name, device)
        return fp8[name]

    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        if not isinstance(k_cache, Fp8Pool):
            return store(k, v, k_cache, v_cache, slot_mapping)
        return bound("store_kv_fp8")(k, v, k_cache.codes, v_cache.codes, k_cache.scales,
                                     v_cache.scales, slot_mapping)

    def paged_attention(out, q, k_cache, v_cache, *rest):
        if not isinstance(k_cache, Fp8Pool):
            return attend(out, q, k_cache, v_cache, *rest)
        return bound("paged_attention_fp8")(out, q, k_cache.codes, v_cache.codes,
                                            k_cache.scales, v_cache.scales, *rest)

    kernels.store_kv, kernels.paged_attention = store_kv, paged_attention


class DecoderLayer:
    def __init__(self, w: LayerWeights, next_norm: Array, cfg: ModelConfig, index: int,
                 rope: Array, kernels: Kernels, arrays: HostArrays | TorchArrays):
        self.ops = kernels
        if cfg.is_linear(index):
            self.attn = GatedDeltaNetBlock(w, cfg, kernels)
        else:
            self.attn = AttentionBlock(w, cfg, rope, kernels, index)
        if cfg.is_sparse(index):
            self.mlp = MoEMLP(w, cfg, kernels, arrays)
        else:
            self.mlp = DenseMLP(w["gate_up"], w["down"], kernels, cfg.activation == "gelu_tanh")
        self.out_norm = kernels.arg(w["mlp_out_norm"]) if "mlp_out_norm" in w else None
        self.next_norm = kernels.arg(next_norm)
        self.eps = cfg.rms_norm_eps

    def forward(self, x: Array, w: WorkViews, batch: ForwardBatch, k_cache: Array,
                v_cache: Array, block_size: int) -> Array:
        """x holds this layer's normed input; returns the buffer with the next one's."""
        self.attn.forward(x, w, batch, k_cache, v_cache, block_size)
        y = self.mlp(x, w)
        if self.out_norm is not None:
            self.ops.rms_norm(y, y, self.out_norm, self.eps)
        self.ops.fused_add_rms_norm(y, w.residual, self.next_norm, self.eps)
        return y


class Decoder:
    """A decoder-only transformer (dense or MoE) over the paged KV cache.

    Attributes: ``config``, ``arrays`` (how its buffers are made), ``device``, ``dtype``
    (activations and KV cache: float32, bfloat16 or float16); ``mtp``: the checkpoint's
    multi-token-prediction block (forward/mtp.py's MTPBlock, set by the loader) or None.
    After each ``forward``, ``last_hidden`` holds the final-normed hidden states of every token
    of the step [T, hidden] (the rows the LM head reads; what the MTP block takes) and
    ``last_residual`` the residual stream before that norm [T, hidden]: views of work buffers
    (kernel arguments; ``arrays.array_view`` gives the array), valid until the next forward.
    """

    def __init__(self, config: ModelConfig, weights: DecoderWeights,
                 arrays: HostArrays | TorchArrays, dtype: str):
        self.config, self.arrays, self.dtype = config, arrays, dtype
        self.device: Device = arrays.device
        quantized_embedding = isinstance(weights.embed, QuantWeight)
        quantized_experts = any(isinstance(lw.get("experts.gate_up"), QuantWeight)
                                for lw in weights.layers)
        self._k = kernels = Kernels(arrays, config, quantized_embedding, quantized_experts)
        self._rope = kernels.arg(arrays.place(cos_sin_cache(config, weights.rope_freq_factors),
                                              "float32"))
        self._local_rope = self._rope
        if config.local_rope_theta is not None:   # gemma3's sliding layers: plain rope
            local = dataclasses.replace(config, rope_theta=config.local_rope_theta,
                                        rope_scaling=None)
            self._local_rope = kernels.arg(arrays.place(cos_sin_cache(local), "float32"))
        norms = [lw["input_norm"] for lw in weights.layers[1:]] + [weights.final_norm]
        self.layers = [DecoderLayer(lw, nxt, config, i,
                                    self._local_rope if config.is_local_rope(i) else self._rope,
                                    kernels, arrays)
                       for i, (lw, nxt) in enumerate(zip(weights.layers, norms))]
        self._first_norm = kernels.arg(weights.layers[0]["input_norm"])
        self._final_norm = kernels.arg(weights.final_norm)
        self.use_fused_layers(self._fused_layers(weights))
        moe_decode.attach(self.layers, weights.layers, config, dtype, arrays)
        self._embed = weights.embed
        self._embed_arg = kernels.arg(weights.embed.data if quantized_embedding else weights.embed)
        self._kv_args: tuple = (None, [], [])
        self._lm_head = make_linear(weights.lm_head)
        self._head_is_f32 = isinstance(weights.lm_head, QuantWeight) or dtype == "float32"
        self._workspace = Workspace(config, dtype, arrays)
        self.mtp = None
        self.last_hidden = self.last_residual = None
        self._dequant = None
        where = str(getattr(arrays, "torch_device", "cpu"))
        if where.startswith("cuda") and _has_blocks(weights):
            # prefill products over GGUF blocks go through one bf16 scratch (dequant.py)
            self._dequant = DequantScratch.for_device(where)
            self._dequant.reserve(dequant.scratch_elements(config))
        if self.device.is_cpu:
            _apply_kernel_threads()

    def use_fused_layers(self, layers: list | None) -> None:
        """Decode steps of up to the layers' max_tokens take these fused layers (None: none)."""
        self._fused = layers
        self._fused_tokens = min((f.max_tokens for f in layers or ()), default=0)

    def _fused_layers(self, weights: DecoderWeights) -> list | None:
        """The fused decode layers (fused_decode.py), where the rule there allows them."""
        if not fused_decode.supported(self.config, weights.layers, self.dtype, self.device):
            return None
        import torch

        where = torch.device(getattr(self.arrays, "torch_device", "cpu"))
        if where.type != "cuda":        # a GPU placement stood in by host tensors (tests)
            return None
        props = torch.cuda.get_device_properties(where)
        return [fused_decode.FusedLayer(layer, lw, self.config, i, self._rope, self._k,
                                        props.multi_processor_count, self.device)
                for i, (layer, lw) in enumerate(zip(self.layers, weights.layers))]

    def _layers_into(self, w: WorkViews, batch: ForwardBatch, kv: KVCache) -> Array:
        """Embed, run every layer; the final-normed hidden states [T, hidden]."""
        self._embed_into(w.residual, batch.input_ids)
        if self.config.embed_scale != 1.0:
            array_view(w.residual)[...] *= self.config.embed_scale
        embeds = batch.multimodal.embeds if batch.multimodal is not None else []
        hidden = self.config.hidden_size
        write_embeds(w.residual, embeds, hidden)
        levels = deepstack_levels(embeds, hidden)
        caches = zip(*self._kv_caches(kv))
        if (self._fused is not None and batch.num_tokens <= self._fused_tokens
                and not levels):
            for layer, (k_cache, v_cache) in zip(self._fused, caches):
                layer.forward(w, batch, k_cache, v_cache, kv.block_size)
            self._k.rms_norm(w.hidden, w.residual, self._final_norm, self.config.rms_norm_eps)
            return w.hidden
        self._k.rms_norm(w.hidden, w.residual, self._first_norm, self.config.rms_norm_eps)
        x = w.hidden
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            x = layer.forward(x, w, batch, k_cache, v_cache, kv.block_size)
            if i < levels:   # DeepStack: the residual leaving layer i, then its norm again
                add_deepstack(w.residual, embeds, i, hidden)
                self._k.rms_norm(x, w.residual, layer.next_norm, self.config.rms_norm_eps)
        return x

    def enable_mrope(self, section: tuple[int, int, int], interleaved: bool,
                     spare_rows: int) -> int:
        """Give the rotary table `spare_rows` rows for image tokens' (t, h, w) positions
        (forward/mrope.py); returns the first spare row's index. Text rows are unchanged."""
        from freetoken.models.forward.mrope import MRopeRows

        self._mrope = MRopeRows(self.config, section, interleaved)
        base = self.config.max_position
        table = np.zeros((base + spare_rows, self._mrope.inv_freq.shape[0] * 2), np.float32)
        table[:base] = cos_sin_cache(self.config)
        self._rope_table = self.arrays.place(table, "float32")
        old, self._rope = self._rope, self._k.arg(self._rope_table)
        for layer in self.layers:
            if getattr(layer.attn, "rope", None) is old:
                layer.attn.rope = self._rope
        for fused in self._fused or ():
            if fused.rope is old:
                fused.rope = self._rope
        return base

    def _write_rope_rows(self, positions) -> None:
        if len(positions):
            base = self.config.max_position
            rows = self._mrope.rows(np.asarray(positions, dtype=np.int64).reshape(-1, 3))
            table = array_view(self._rope_table)
            if is_torch(table):
                import torch

                table[base:base + rows.shape[0]].copy_(torch.from_numpy(rows))
            else:
                table[base:base + rows.shape[0]] = rows

    def reserve(self, max_tokens: int) -> None:
        """Preallocate work buffers for steps of up to `max_tokens` tokens."""
        self._workspace.reserve(max_tokens)
        if self._dequant is not None and max_tokens > dequant.MIN_TOKENS:
            self._dequant.allocate()

    @property
    def kernels(self) -> Kernels:
        """The ops bound for this model's device (the MTP block runs its layer with them)."""
        return self._k

    @property
    def rope(self) -> Array:
        """The rotary cos/sin table the attention layers read (a kernel argument)."""
        return self._rope

    def embed_into(self, out: Array, ids: Array) -> None:
        """out[T, hidden] = the embedding rows of token ids [T] (kernel arguments)."""
        self._embed_into(out, ids)

    def logits(self, rows: Array) -> Array:
        """float32 logits [R, vocab] of final-normed hidden rows [R, hidden] (a kernel
        argument) through this model's LM head and soft cap, as ``forward`` computes them."""
        logits = self.arrays.empty((rows.shape[0], self.config.vocab_size), "float32")
        if self._head_is_f32:
            self._lm_head(self._k.arg(logits), rows)
        else:
            low = self.arrays.empty(logits.shape, self.dtype)
            self._lm_head(low, rows)
            logits[...] = low
        if self.config.final_logit_softcap > 0:
            _soft_cap(logits, self.config.final_logit_softcap)
        return logits

    def _embed_into(self, out, ids) -> None:
        if isinstance(self._embed, QuantWeight):
            self._k.embed(out, ids, self._embed_arg, self._embed.qtype)
        else:
            self._k.embed(out, ids, self._embed_arg)

    def _kv_caches(self, kv: KVCache) -> tuple[list, list]:
        """The pools as kernel arguments, converted once per KV cache."""
        if self._kv_args[0] is not kv:
            arg = self._k.kv_arg
            self._kv_args = (kv, [arg(k) for k in kv.k], [arg(v) for v in kv.v])
        return self._kv_args[1], self._kv_args[2]

    def forward(self, batch: ForwardBatch, kv: KVCache) -> Array:
        """float32 logits [R, vocab] for the R rows batch.logits_indices of this step (R = B:
        each sequence's last token, unless a verify step asks for every draft's)."""
        arg = self._k.arg
        batch = dataclasses.replace(batch, **{f.name: arg(getattr(batch, f.name))
                                              for f in dataclasses.fields(batch)
                                              if f.name not in ("max_query_len", "multimodal")
                                              and getattr(batch, f.name) is not None})
        if batch.multimodal is not None:
            self._write_rope_rows(batch.multimodal.rope_positions)
        w = self._workspace.views(batch.num_tokens)
        x = rows = self._layers_into(w, batch, kv)
        self.last_hidden, self.last_residual = x, w.residual
        num_rows = batch.logits_indices.shape[0]
        if batch.num_tokens != num_rows:  # else every token's logits, in order
            rows = arg(self.arrays.empty((num_rows, self.config.hidden_size), self.dtype))
            self._k.gather_rows(rows, batch.logits_indices, x)
        return self.logits(rows)


def _soft_cap(logits, cap: float) -> None:
    """In place: logits = cap * tanh(logits / cap)."""
    if is_torch(logits):
        logits.div_(cap).tanh_().mul_(cap)
        return
    np.tanh(logits / cap, out=logits)
    logits *= cap


def _has_blocks(weights: DecoderWeights) -> bool:
    """Whether any layer weight is GGUF blocks (a fused entry may be a list of row parts)."""
    for lw in weights.layers:
        for value in lw.values():
            parts = value if isinstance(value, list) else [value]
            if any(isinstance(p, QuantWeight) for p in parts):
                return True
    return False


def _apply_kernel_threads() -> None:
    """Size the CPU kernels' shared thread pool from FREETOKEN_NUM_THREADS (0 = every core)."""
    from freetoken import env

    threads = env.read().num_threads
    if threads > 0:
        ops.bind("set_num_threads", "cpu")(threads)
