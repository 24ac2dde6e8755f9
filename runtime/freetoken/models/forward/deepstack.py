"""Image tokens' rows of the decoder's residual stream: the vision tower's embeddings replace
the placeholder tokens' embeddings, and Qwen3-VL's DeepStack features are added after the
first layers (transformers' Qwen3VLTextModel._deepstack_process: feature j joins the hidden
states that leave layer j, at the image tokens only).

Each (token row, rows) of MultimodalBatch.embeds holds [count, hidden * (1 + levels)]: the
embeddings, then one feature per level (VisionTower.encode), so a chunk that cuts an image
carries exactly its own tokens' features."""

from __future__ import annotations

from freetoken.arrays import array_view, is_torch


def deepstack_levels(embeds, hidden: int) -> int:
    """How many DeepStack features the step's image rows carry (0: none, or no images)."""
    widths = {rows.shape[1] for _, rows in embeds}
    if not widths:
        return 0
    if len(widths) != 1 or next(iter(widths)) % hidden:
        raise ValueError(f"image embedding widths {sorted(widths)} are not one multiple of "
                         f"the hidden size {hidden}")
    return next(iter(widths)) // hidden - 1


def write_embeds(residual, embeds, hidden: int) -> None:
    """Image tokens' rows of the embedded input replaced by the vision tower's output."""
    _apply(residual, embeds, 0, hidden, add=False)


def add_deepstack(residual, embeds, level: int, hidden: int) -> None:
    """Feature `level` added to the image tokens' rows of the residual stream."""
    _apply(residual, embeds, 1 + level, hidden, add=True)


def _apply(residual, embeds, part: int, hidden: int, add: bool) -> None:
    out = array_view(residual)
    columns = slice(part * hidden, (part + 1) * hidden)
    for row, rows in embeds:
        target = out[row:row + rows.shape[0]]
        values = rows[:, columns]
        if is_torch(out):
            if add:
                target.add_(values.to(target.dtype))
            else:
                target.copy_(values)
            continue
        values = values.numpy() if is_torch(values) else values
        if add:
            target += values.astype(target.dtype, copy=False)
        else:
            target[...] = values
