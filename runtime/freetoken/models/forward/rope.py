"""The rotary cos/sin table the rotary kernel reads, with the supported rope scalings."""

from __future__ import annotations

import math

import numpy as np

from freetoken.models.config import ModelConfig
from freetoken.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_ramp(scaling: dict, rot: int, theta: float) -> np.ndarray:
    """float32 [rot / 2]: 0 where a frequency keeps its speed, 1 where it is interpolated.

    A frequency that turns more than beta_fast times over the original context is kept, one
    that turns fewer than beta_slow times is slowed by `factor`; between them a linear ramp."""
    context = float(scaling["original_max_position_embeddings"])

    def index_for(rotations: float) -> float:
        return rot * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = index_for(float(scaling.get("beta_fast") or 32))
    high = index_for(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001   # keeps the ramp finite
    ramp = (np.arange(rot // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    return np.clip(ramp, 0, 1).astype(np.float32)


def _yarn_inv_freq(inv_freq: np.ndarray, scaling: dict, rot: int, theta: float) -> np.ndarray:
    """Blend of the original speeds and the speeds slowed by `factor` (see `_yarn_ramp`)."""
    keep = np.float32(1) - _yarn_ramp(scaling, rot, theta)
    slowed = inv_freq / np.float32(scaling["factor"])
    return slowed * (np.float32(1) - keep) + inv_freq * keep


def attention_factor(config: ModelConfig) -> float:
    """The factor on cos and sin: YaRN's attention temperature, 1.0 for other scalings."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


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
    elif kind == "yarn":
        inv_freq = _yarn_inv_freq(inv_freq, scaling, rot, float(config.rope_theta))
    elif kind != "default":
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if freq_factors is not None:   # GGUF rope_freqs: per-frequency divisors
        inv_freq = inv_freq / freq_factors.astype(np.float32)
    return inv_freq.astype(np.float32)


def cos_sin_cache(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """float32 [max_position, rot_dim] = cat(cos, sin) per position, in host memory,
    times the scaling's attention factor (YaRN; 1.0 otherwise)."""
    inv_freq = inverse_frequencies(config, freq_factors)
    positions = np.arange(config.max_position, dtype=np.float32)
    angles = np.outer(positions, inv_freq)
    table = np.concatenate((np.cos(angles), np.sin(angles)), axis=-1)
    scale = attention_factor(config)
    if scale != 1.0:
        table = table * np.float32(scale)
    return np.ascontiguousarray(table, dtype=np.float32)
