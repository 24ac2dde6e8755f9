"""What the vision tower derives from each image's patch grid alone, computed on the host:
the (row, col) of every patch in merge-block order, the bilinear taps into the learned square
position table, and the attention segments. Patches arrive in the HF processor's order: per
frame, 2x2 merge blocks row-major, and within a block its 2x2 patches row-major."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def patch_rows_cols(grid_thw: tuple[int, int, int], merge: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [t*h*w] row and column of each patch, in the processor's patch order."""
    t, h, w = grid_thw
    index = np.arange(h * w, dtype=np.int64)
    blocks_w = w // merge
    in_col, in_row = index % merge, (index // merge) % merge
    block_col = (index // (merge * merge)) % blocks_w
    block_row = index // (merge * merge * blocks_w)
    rows, cols = block_row * merge + in_row, block_col * merge + in_col
    return np.tile(rows, t), np.tile(cols, t)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor+1, clamped to the table) and weights for `index` on an axis
    of `size` cells resampled from `side` (align_corners=True: both ends map to the ends)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights.astype(np.float32)


def position_taps(grids: Sequence[tuple[int, int, int]], merge: int, side: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """int64 [N, 4] rows of the side x side position table and float32 [N, 4] weights whose
    weighted sum is each patch's position embedding (HF: F.interpolate bilinear, corners
    aligned, done as a gather)."""
    all_taps, all_weights = [], []
    for grid in grids:
        rows, cols = patch_rows_cols(grid, merge)
        h_taps, h_w = _axis_taps(rows, grid[1], side)
        w_taps, w_w = _axis_taps(cols, grid[2], side)
        all_taps.append((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4))
        all_weights.append((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4))
    return np.concatenate(all_taps), np.concatenate(all_weights)


def rotary_positions(grids: Sequence[tuple[int, int, int]], merge: int) -> np.ndarray:
    """int64 [N, 2] (row, col) of every patch: the tower's 2-D rotary positions."""
    parts = [np.stack(patch_rows_cols(grid, merge), axis=-1) for grid in grids]
    return np.concatenate(parts)


def segment_bounds(grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """int32 [S+1] cumulative patch counts: one attention segment per frame of each image."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    return np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
