"""Model architecture and weight descriptions shared by loaders, models and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class MoEConfig:
    """The routed-expert MLP of an MoE model (the layers that have one)."""

    num_experts: int
    top_k: int                         # experts per token
    intermediate_size: int             # per expert
    renormalize: bool                  # divide the top-k probabilities by their sum
    shared_intermediate_size: int = 0  # qwen2_moe: an always-on expert gated by sigmoid (0: none)
    sparse_layers: tuple[bool, ...] = ()   # per layer: True = MoE, False = dense MLP

    def expert_params(self, hidden_size: int) -> int:
        """Weights of one routed expert (gate, up and down projections)."""
        return 3 * hidden_size * self.intermediate_size


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model (Qwen3-Next, Qwen3.5/3.6)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int                   # taps of the short causal convolution over q, k, v
    # The out projection reads the value heads tiled over the key heads (head i * Hk + g,
    # llama.cpp's qwen35 GGUF layout) instead of grouped by key head (g * Hv/Hk + i): every
    # other tensor is read back in grouped order, the forward reorders the out projection's
    # input (its quantized columns cannot be moved block by block).
    tiled_value_heads: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projection_size(self) -> int:
        """Rows of the fused input projection: q, k, v, then z (output gate), b and a."""
        return self.conv_dim + self.value_dim + 2 * self.num_v_heads

    def params(self, hidden_size: int) -> int:
        """Weights of one GDN token mixer (projections, conv, decay parameters, norm)."""
        return (hidden_size * self.projection_size + self.conv_dim * self.conv_kernel
                + 2 * self.num_v_heads + self.head_v_dim + self.value_dim * hidden_size)

    def state_bytes(self, itemsize: int) -> int:
        """Recurrent state of one sequence in one layer: conv inputs (activation dtype) and
        the f32 delta-rule state."""
        conv = self.conv_dim * (self.conv_kernel - 1) * itemsize
        return conv + 4 * self.num_v_heads * self.head_k_dim * self.head_v_dim


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's shape; filled from config.json or GGUF metadata."""

    architecture: str          # registry name: llama, qwen2, qwen3, mistral, qwen3_moe, ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    rope_dim: int | None = None        # rotated dims per head (None = head_dim)
    rope_is_neox: bool = True          # HF layout (halves); GGUF llama weights are permuted back
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # qwen2: q/k/v projections carry a bias
    qk_norm: str | None = None         # "head": RMSNorm per q/k head (qwen3); "full": over the
                                       # whole q and k projections (olmoe)
    sliding_window: int = 0            # mistral-style local attention (0 = full)
    sliding_layers: tuple[bool, ...] = ()   # per layer: the window applies (empty: every layer)
    local_rope_theta: float | None = None   # gemma3: rope base of the sliding layers (default
                                            # rope); None: every layer uses rope_theta
    activation: str = "silu"           # the MLP gate: "silu" or "gelu_tanh"
    embed_scale: float = 1.0           # gemma: the embedding times sqrt(hidden)
    attn_scale: float | None = None    # q . k scale (None: head_dim ** -0.5)
    block_out_norms: bool = False      # gemma3: attention and MLP outputs are normed
    final_logit_softcap: float = 0.0   # logits = cap * tanh(logits / cap) when > 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None       # None: a dense MLP in every layer
    linear: LinearAttentionConfig | None = None   # hybrid models: their GDN layers' shape
    linear_layers: tuple[bool, ...] = ()   # per layer: True = GDN, False (or empty) = attention
    attn_output_gate: bool = False     # q_proj doubled: attention output * sigmoid(gate)
    norm_offset: bool = False          # RMSNorms scale by (1 + w) (folded in at load)
    mtp_num_hidden_layers: int = 0     # decoder layers of the checkpoint's multi-token-
                                       # prediction block (0: none declared; forward/mtp.py)

    def is_linear(self, layer: int) -> bool:
        """True when `layer` is a Gated DeltaNet layer (no KV cache, a recurrent state)."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def kv_layers(self) -> list[int]:
        """The layers that keep K/V in the paged pool."""
        return [i for i in range(self.num_layers) if not self.is_linear(i)]

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (0: full attention)."""
        if not self.sliding_layers:
            return self.sliding_window
        return self.sliding_window if self.sliding_layers[layer] else 0

    def is_local_rope(self, layer: int) -> bool:
        """True when `layer` rotates with local_rope_theta."""
        return self.local_rope_theta is not None and self.window(layer) > 0

    def is_sparse(self, layer: int) -> bool:
        """True when `layer` routes its MLP through experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    @property
    def active_params_per_token(self) -> int:
        """Weights one token computes with: all of them but the experts it is not routed to."""
        total = self.num_params
        if self.moe is not None:
            sparse = sum(self.moe.sparse_layers)
            idle = self.moe.num_experts - self.moe.top_k
            total -= sparse * idle * self.moe.expert_params(self.hidden_size)
        return total

    @property
    def num_params(self) -> int:
        """Every weight of the model (the embedding and an untied head counted once each)."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        norms = {"head": 2 * self.head_dim, "full": self.q_size + self.kv_size}
        attn += norms.get(self.qk_norm or "", 0) + (2 * h if self.block_out_norms else 0)
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        if self.attn_output_gate:
            attn += h * self.q_size
        for layer in range(self.num_layers):
            mixer = attn
            if self.is_linear(layer):
                mixer = self.linear.params(h) + 2 * h
            total += mixer + self._mlp_params(layer)
        return total

    def _mlp_params(self, layer: int) -> int:
        h, moe = self.hidden_size, self.moe
        if moe is None or not moe.sparse_layers[layer]:
            return 3 * h * self.intermediate_size
        shared = 3 * h * moe.shared_intermediate_size + (h if moe.shared_intermediate_size else 0)
        return h * moe.num_experts + moe.num_experts * moe.expert_params(h) + shared

    def mtp_block(self, sparse: bool = True) -> ModelConfig:
        """The shape of the MTP block's decoder layers as a config of their own: its
        (at least one) full-attention layers over the target's attention and MLP shapes, no
        GDN layers, routed experts where `sparse`. Its kv_layers are the MTP's KV pool."""
        layers = max(self.mtp_num_hidden_layers, 1)
        moe = None if self.moe is None else replace(self.moe, sparse_layers=(sparse,) * layers)
        return replace(self, num_layers=layers, linear=None, linear_layers=(), moe=moe,
                       sliding_layers=(), local_rope_theta=None)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF-quantized matrix kept as its raw blocks: one weight row per `data` row."""

    qtype: int                 # GGML type id (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12,
                               # Q5_K=13, Q6_K=14)
    data: Any                  # numpy uint8 [..., rows, row_bytes]
    shape: tuple[int, ...]     # logical [..., rows, cols]: (out_features, in_features), with
                               # a leading expert axis for stacked experts


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a model ships (generation_config.json or GGUF metadata)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)
