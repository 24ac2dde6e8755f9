"""The rotary cos/sin table the rotary kernel reads, with the supported rope scalings."""

from __future__ import annotations

import math

import numpy as np

from freetoken.models.config import ModelConfig
from freetoken.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Long wavelengths slow down by `factor`, short ones stay, the band between blends."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return np.where(medium, smoothed, scaled)


def inverse_frequencies(config: ModelConfig, freq_factors: np.ndarray | None = None
                        ) -> np.ndarray:
    """float32 [rot_dim / 2] rotation speeds, scaled as the model's rope_scaling says."""
    rot = config.rope_dim or config.head_dim
    exponents = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
    inv_freq = np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind != "default":
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if freq_factors is not None:   # GGUF rope_freqs: per-frequency divisors
        inv_freq = inv_freq / freq_factors.astype(np.float32)
    return inv_freq.astype(np.float32)


def cos_sin_cache(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """float32 [max_position, rot_dim] = cat(cos, sin) per position, in host memory."""
    inv_freq = inverse_frequencies(config, freq_factors)
    positions = np.arange(config.max_position, dtype=np.float32)
    angles = np.outer(positions, inv_freq)
    return np.ascontiguousarray(np.concatenate((np.cos(angles), np.sin(angles)), axis=-1),
                                dtype=np.float32)
