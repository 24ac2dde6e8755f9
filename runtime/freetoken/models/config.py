"""Model architecture and weight descriptions shared by loaders, models and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder's shape; filled from config.json or GGUF metadata."""

    architecture: str          # registry name: llama, qwen2, qwen3, mistral
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
    qk_norm: bool = False              # qwen3: RMSNorm over each q and k head
    sliding_window: int = 0            # mistral-style local attention (0 = full)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class QuantWeight:
    """A GGUF-quantized matrix kept as its raw blocks: one weight row per `data` row."""

    qtype: int                 # GGML type id (Q4_0=2, Q4_1=3, Q8_0=8)
    data: Any                  # numpy uint8 [rows, row_bytes]
    shape: tuple[int, int]     # logical [rows, cols] (out_features, in_features)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults a model ships (generation_config.json or GGUF metadata)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)
