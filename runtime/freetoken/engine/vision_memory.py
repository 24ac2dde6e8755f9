"""The vision tower's share of the memory plan: its weights, the encoder cache at capacity and
the work buffers of one step's encoding, so a vision-language model's KV pool leaves room for
images. Pure arithmetic over the tower's shape, like memory_plan.py."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.engine.memory_plan import _ITEM
from freetoken.engine.vision_setup import encoder_cache_rows
from freetoken.models.checkpoint.vision_config import VisionConfig

FLOAT32 = 4


@dataclass(frozen=True)
class VisionBudget:
    """What the plan needs to know about images: the tower's shape and the largest area an
    image is resized to (the model's max_pixels, or --max-image-pixels)."""

    config: VisionConfig
    max_pixels: int


def bytes_per_patch(config: VisionConfig, item: int) -> int:
    """Peak bytes per patch while VisionTower.encode runs (an upper estimate): the float32
    rotary tables throughout, plus the largest of the patch embedding (float32 pixels and
    their cast, the residual, four gathered position rows, their float32 blend and sum), the
    rotation of k (the residual, qkv and q beside five float32 temporaries) and a block's end
    (its locals live until it returns: the old and new residual, qkv, q, k, attention out,
    projection, and both MLP activations). DeepStack features are kept from their block to
    the end: out_hidden per merged token each."""
    h = config.hidden_size
    features = len(config.deepstack_visual_indexes) * config.out_hidden_size
    steady = 2 * FLOAT32 * config.head_dim + -(-item * features // config.spatial_merge_size ** 2)
    embed = (FLOAT32 + item) * config.patch_dim + item * h + (4 * item + 5 * FLOAT32) * h
    rotation = 5 * item * h + 5 * FLOAT32 * h
    block_end = item * (9 * h + 2 * config.intermediate_size)
    return steady + max(embed, rotation, block_end)


def step_patches(budget: VisionBudget, max_step_tokens: int) -> int:
    """Patches one step may encode: a step encodes every image its chunk touches whole, so at
    most the largest image (cut by the chunk) and a chunk full of smaller ones."""
    c = budget.config
    return budget.max_pixels // c.patch_size ** 2 + c.spatial_merge_size ** 2 * max_step_tokens


def vision_pools(budget: VisionBudget, dtype: str, max_step_tokens: int
                 ) -> tuple[dict[str, int], dict[str, str]]:
    """(pools, notes) for the plan: vision_weights, encoder_cache, vision_workspace."""
    c, item = budget.config, _ITEM[dtype]
    rows = encoder_cache_rows(max_step_tokens)
    patches = step_patches(budget, max_step_tokens)
    per_patch = bytes_per_patch(c, item)
    pools = {"vision_weights": c.num_params * item,
             "encoder_cache": rows * c.embed_width * item,
             "vision_workspace": patches * per_patch}
    notes = {"encoder_cache": f"{rows} rows x {c.embed_width * item / 1024:.1f} KiB",
             "vision_workspace": f"{patches} patches x {per_patch / 1024:.1f} KiB: an image "
                                 f"of {budget.max_pixels} pixels and a step of smaller ones"}
    return pools, notes
