"""Multimodal rotary rows: an image token has a (t, h, w) position, and each rotary frequency
turns by one of the three (HF's mrope_section, interleaved: frequency i follows h when
i % 3 == 1 and i < 3 * section[1], w when i % 3 == 2 and i < 3 * section[2], t otherwise;
or, not interleaved, contiguous runs of section[0], section[1], section[2] frequencies).

The rotary kernels read cos/sin rows of one table by a per-token index, so the decoder's table
gets `rows` spare rows after the max_position text rows: a step writes the rows of its image
tokens there and points those tokens' positions at them. Text tokens (t = h = w) keep their
ordinary rows, so text-only steps are untouched."""

from __future__ import annotations

import numpy as np

from freetoken.models.config import ModelConfig
from freetoken.models.forward.rope import attention_factor, inverse_frequencies


def frequency_axes(num_freqs: int, section: tuple[int, int, int], interleaved: bool
                   ) -> np.ndarray:
    """int64 [num_freqs]: 0 (t), 1 (h) or 2 (w) per rotary frequency."""
    axes = np.zeros(num_freqs, dtype=np.int64)
    i = np.arange(num_freqs)
    if interleaved:
        axes[(i % 3 == 1) & (i < 3 * section[1])] = 1
        axes[(i % 3 == 2) & (i < 3 * section[2])] = 2
    else:
        axes[(i >= section[0]) & (i < section[0] + section[1])] = 1
        axes[i >= section[0] + section[1]] = 2
    return axes


class MRopeRows:
    """cos/sin rows (the table's layout: cat(cos, sin), float32) for (t, h, w) positions."""

    def __init__(self, config: ModelConfig, section: tuple[int, int, int], interleaved: bool):
        self.inv_freq = inverse_frequencies(config)
        self.axes = frequency_axes(self.inv_freq.shape[0], section, interleaved)
        self.scale = attention_factor(config)

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """float32 [K, rot_dim] for int64 positions [K, 3]."""
        chosen = positions[:, self.axes].astype(np.float32)       # [K, rot / 2]
        angles = chosen * self.inv_freq[None, :]
        table = np.concatenate((np.cos(angles), np.sin(angles)), axis=-1)
        if self.scale != 1.0:
            table = table * np.float32(self.scale)
        return np.ascontiguousarray(table, dtype=np.float32)
