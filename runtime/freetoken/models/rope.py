"""The rotary cos/sin table the rotary kernel reads, with the supported rope scalings."""

from __future__ import annotations

import math

import torch

from freetoken.models.config import ModelConfig
from freetoken.models.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Long wavelengths slow down by `factor`, short ones stay, the band between blends."""
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """float32 [rot_dim / 2] rotation speeds, scaled as the model's rope_scaling says."""
    rot = config.rope_dim or config.head_dim
    exponents = torch.arange(0, rot, 2, dtype=torch.int64).float() / rot
    inv_freq = 1.0 / (config.rope_theta ** exponents)
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
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def cos_sin_cache(config: ModelConfig, device: torch.device,
                  freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [max_position, rot_dim] = cat(cos, sin) per position, on `device`."""
    inv_freq = inverse_frequencies(config, freq_factors)
    positions = torch.arange(config.max_position, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).contiguous().to(device)
