"""``ScaledWeight``: a matrix stored in a low-precision float format with the scales its format
defines, kept as the checkpoint's bytes (FP8 e4m3, NVFP4 e2m1) until a kernel or ``dequantize``
applies them.

Every layout reduces to one rule. With the scale grid ``scales`` of shape
[..., ceil(O / bn), ceil(I / bk)] and ``block = (bn, bk)``::

    W[o, i] = value(data)[o, i] * scales[o // bn, i // bk] * (row_scale[o] if row_scale else 1)

FP8 per-tensor scales are a [1, 1] grid with block (O, I); per-channel a [O, 1] grid with
block (1, I); DeepSeek/Qwen blocks a [ceil(O/128), ceil(I/128)] grid with block (128, 128).
NVFP4 packs two e2m1 values per byte (the even column in the low nibble), with an e4m3 scale
per 16 columns (block (1, 16)) and the per-tensor second-level scale in ``row_scale`` (one
value per row, so q/k/v or gate/up rows from separately scaled tensors can be concatenated).
Needs torch (HF safetensors are read through it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

FP8 = "fp8_e4m3"
NVFP4 = "nvfp4"
FORMATS = (FP8, NVFP4)
# e2m1 code (low 3 bits) -> magnitude; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class ScaledWeight:
    """A scaled low-precision matrix (see the module docstring for the dequantization rule)."""

    format: str                    # FP8 | NVFP4
    data: Any                      # FP8: float8_e4m3fn [..., O, I]; NVFP4: uint8 [..., O, I/2]
    scales: Any                    # FP8: float32 grid; NVFP4: float8_e4m3fn [..., O, I/16]
    shape: tuple[int, ...]         # logical [..., O, I] (a leading expert axis when stacked)
    block: tuple[int, int]         # (rows, cols) one scale covers
    row_scale: Any = None          # float32 [..., O] or None

    @property
    def rows(self) -> int:
        return self.shape[-2]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def kernel_ready(weight: ScaledWeight) -> bool:
    """Whether the GPU kernels take this layout: 16 values share one scale (columns a
    multiple of 16, column blocks too unless one block spans the row)."""
    return takes_layout(weight.shape[-1], weight.block[1])


def takes_layout(cols: int, block_cols: int) -> bool:
    """kernel_ready for a weight of `cols` columns with a scale per `block_cols` of them."""
    return cols % 16 == 0 and (block_cols % 16 == 0 or block_cols >= cols)


def e2m1_to_float(packed):
    """float32 [..., 2n] values of packed e2m1 bytes [..., n] (low nibble first)."""
    import torch

    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    return torch.stack((table[low], table[high]), dim=-1).flatten(-2)


def expand_grid(grid, block: tuple[int, int], rows: int, cols: int):
    """A scale grid [..., ceil(rows/bn), ceil(cols/bk)] repeated to one value per element
    [..., rows, cols]; partial edge blocks are cut."""
    bn, bk = block
    full = grid.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :rows, :cols]


def dequantize(weight: ScaledWeight):
    """float32 torch tensor [..., O, I] of a scaled weight (on the weight's device)."""
    import torch

    rows, cols = weight.shape[-2], weight.shape[-1]
    if weight.format == FP8:
        values = weight.data.to(torch.float32)
    else:
        values = e2m1_to_float(weight.data)
    scale = expand_grid(weight.scales.to(torch.float32), weight.block, rows, cols)
    out = values * scale
    if weight.row_scale is not None:
        out = out * weight.row_scale.to(torch.float32).unsqueeze(-1)
    return out


def per_row(weight: ScaledWeight) -> ScaledWeight:
    """The same values with one scale row per weight row (block (1, bk)): exact, and what
    lets row slices and concatenations cut anywhere."""
    bn, bk = weight.block
    if bn == 1:
        return weight
    grid = weight.scales.repeat_interleave(bn, dim=-2)[..., :weight.rows, :]
    return replace(weight, scales=grid.contiguous(), block=(1, bk))


def slice_rows(weight: ScaledWeight, start: int, stop: int) -> ScaledWeight:
    """Rows start..stop of the last-but-one axis, scales and row scales sliced alike."""
    bn = weight.block[0]
    if start % bn or (stop % bn and stop != weight.rows):
        weight = per_row(weight)
        bn = 1
    grid = weight.scales[..., start // bn:_ceil(stop, bn), :]
    rows = None if weight.row_scale is None else weight.row_scale[..., start:stop]
    shape = weight.shape[:-2] + (stop - start, weight.shape[-1])
    return ScaledWeight(weight.format, weight.data[..., start:stop, :], grid, shape,
                        (min(bn, stop - start), weight.block[1]), rows)


def concat_rows(parts: list[ScaledWeight]) -> ScaledWeight | None:
    """One weight of the parts' rows in order (same format, columns and column blocks), or
    None when they cannot share one scale layout."""
    import torch

    first = parts[0]
    if any(p.format != first.format or p.shape[:-2] != first.shape[:-2]
           or p.shape[-1] != first.shape[-1] for p in parts):
        return None
    if first.format == FP8:
        # per-tensor scales become per-row ones: a [1, 1] grid of block (O, I) is (1, I) rows
        parts = [_tensor_as_rows(p) for p in parts]
    if len({p.block[1] for p in parts}) != 1:
        return None
    bn = parts[0].block[0]
    if len({p.block[0] for p in parts}) != 1 or any(p.rows % bn for p in parts[:-1]):
        parts = [per_row(p) for p in parts]
    with_rows = [p.row_scale is not None for p in parts]
    if any(with_rows) and not all(with_rows):
        return None
    rs = [p.row_scale for p in parts] if all(with_rows) else None
    data = torch.cat([p.data for p in parts], dim=-2)
    grid = torch.cat([p.scales for p in parts], dim=-2)
    row_scale = None if rs is None else torch.cat(rs, dim=-1)
    rows = sum(p.rows for p in parts)
    return ScaledWeight(first.format, data, grid, first.shape[:-2] + (rows, first.shape[-1]),
                        parts[0].block, row_scale)


def _tensor_as_rows(weight: ScaledWeight) -> ScaledWeight:
    """A per-tensor FP8 scale ([1, 1] grid over the whole matrix) as a per-row column."""
    if weight.block != (weight.rows, weight.shape[-1]) or weight.rows == 1:
        return weight
    grid = weight.scales.expand(*weight.scales.shape[:-2], weight.rows, 1).contiguous()
    return replace(weight, scales=grid, block=(1, weight.shape[-1]))


def stack(parts: list[ScaledWeight]) -> ScaledWeight:
    """Per-expert weights [O, I] stacked into one [E, O, I] (scale layouts made to agree)."""
    import torch

    first = parts[0]
    if len({(p.block, tuple(p.scales.shape)) for p in parts}) != 1:
        parts = [per_row(_tensor_as_rows(p)) for p in parts]
    rows = None
    if all(p.row_scale is not None for p in parts):
        rows = torch.stack([p.row_scale for p in parts])
    return ScaledWeight(first.format, torch.stack([p.data for p in parts]),
                        torch.stack([p.scales for p in parts]), (len(parts),) + first.shape,
                        parts[0].block, rows)


def to_device(weight: ScaledWeight, device) -> ScaledWeight:
    """The weight with its bytes and scales on a torch device (formats kept as they are)."""
    def move(t):
        return None if t is None else t.to(device).contiguous()

    return replace(weight, data=move(weight.data), scales=move(weight.scales),
                   row_scale=move(weight.row_scale))
