"""The Qwen3-VL / Qwen3.5/3.6 vision tower: patches in, one embedding per 2x2 patch block out,
in the text model's hidden size (transformers' Qwen3VLVisionModel / Qwen3_5MoeVisionModel, their
pooler output and Qwen3-VL's DeepStack features).

patch embedding (a Conv3d whose stride is its kernel: a linear over the flattened patch) + the
learned position table resampled to the image's grid -> `depth` blocks (LayerNorm, fused qkv,
2-D rotary, non-causal attention within each image, projection; LayerNorm, MLP with GELU-tanh)
-> the merger (LayerNorm per patch, 4 patches concatenated, Linear, GELU, Linear). Qwen3-VL
also merges the output of each block in `deepstack_visual_indexes` with a merger of its own,
whose LayerNorm comes after the 4 patches are concatenated.

Runs in torch on the model's device (float32 on the CPU, the model dtype on a GPU); the GEMMs
go through the decoder's linear path; attention is the cache's ``vision_attention`` kernel, every
image of the batch in one launch (tensor cores for bf16/f16 on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from freetoken.kernel import ops
from freetoken.models.checkpoint.vision_config import VisionConfig
from freetoken.models.forward.linear import DenseLinear
from freetoken.models.forward.vision_grid import (position_taps, rotary_positions,
                                                  segment_bounds)

LAYER_NORM_EPS = 1e-6


class VisionBlock:
    def __init__(self, w: dict[str, Any], i: int, config: VisionConfig):
        p = f"blocks.{i}."
        self.norm1 = (w[p + "norm1.weight"], w[p + "norm1.bias"])
        self.norm2 = (w[p + "norm2.weight"], w[p + "norm2.bias"])
        self.qkv = DenseLinear(w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"])
        self.proj = DenseLinear(w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
        self.fc1 = DenseLinear(w[p + "mlp.linear_fc1.weight"], w[p + "mlp.linear_fc1.bias"])
        self.fc2 = DenseLinear(w[p + "mlp.linear_fc2.weight"], w[p + "mlp.linear_fc2.bias"])
        self.tanh_gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.heads, self.head_dim = config.num_heads, config.head_dim


class PatchMerger:
    """2x2 patches -> one text-model embedding: LayerNorm (per patch, or over the 4
    concatenated patches when `post_shuffle`), Linear, GELU (erf), Linear."""

    def __init__(self, w: dict[str, Any], prefix: str, post_shuffle: bool):
        self.norm = (w[prefix + "norm.weight"], w[prefix + "norm.bias"])
        self.fc1 = DenseLinear(w[prefix + "linear_fc1.weight"], w[prefix + "linear_fc1.bias"])
        self.fc2 = DenseLinear(w[prefix + "linear_fc2.weight"], w[prefix + "linear_fc2.bias"])
        self.post_shuffle = post_shuffle


class VisionTower:
    """Encodes images (``ImageInput``s) into text-model embeddings.

    Args:
        config: the tower's shape.
        weights: read_vision_weights' dict, already on `device` in `dtype`.
        device: the model's Device (cpu or cuda[:N]); dtype a torch dtype name.
    """

    def __init__(self, config: VisionConfig, weights: dict[str, Any], device: Any, dtype: str):
        import torch

        self.torch, self.config, self.device = torch, config, device
        self.torch_device = torch.device(str(device))
        self.dtype = getattr(torch, dtype)
        patch = weights["patch_embed.proj.weight"]
        self.patch_embed = DenseLinear(patch.reshape(patch.shape[0], -1),
                                       weights["patch_embed.proj.bias"])
        self.pos_table = weights["pos_embed.weight"]
        self.side = round(config.num_position_embeddings ** 0.5)
        self.blocks = [VisionBlock(weights, i, config) for i in range(config.depth)]
        self.merger = PatchMerger(weights, "merger.", post_shuffle=False)
        # block index -> its DeepStack merger (the list is in deepstack_visual_indexes order)
        self.deepstack = {block: PatchMerger(weights, f"deepstack_merger_list.{j}.", True)
                          for j, block in enumerate(config.deepstack_visual_indexes)}
        half = config.head_dim // 2     # h and w each rotate a quarter of the head
        exponents = torch.arange(0, half, 2, dtype=torch.float) / half
        self.inv_freq = (1.0 / (config.rope_theta ** exponents)).to(self.torch_device)
        self.attention = ops.bind("vision_attention", device)

    def _empty(self, *shape):
        return self.torch.empty(shape, dtype=self.dtype, device=self.torch_device)

    def _host(self, array: np.ndarray):
        return self.torch.from_numpy(array).to(self.torch_device)

    def _embed(self, images: Sequence[Any], grids: list) -> Any:
        """Patch embeddings plus the resampled learned positions: [N, hidden]."""
        pixels = np.concatenate([np.asarray(im.pixel_values, dtype=np.float32) for im in images])
        if pixels.shape[1] != self.config.patch_dim:
            raise ValueError(f"pixel_values rows hold {pixels.shape[1]} values; this tower "
                             f"takes {self.config.patch_dim} per patch")
        x = self._empty(pixels.shape[0], self.config.hidden_size)
        self.patch_embed(x, self._host(pixels).to(self.dtype))
        taps, weights = position_taps(grids, self.config.spatial_merge_size, self.side)
        # float32 like HF: the gathered rows times float32 weights, summed, then rounded
        pos = (self.pos_table[self._host(taps)] * self._host(weights)[:, :, None]).sum(1)
        return x + pos.to(self.dtype)

    def _rotary(self, grids: list) -> tuple[Any, Any]:
        """float32 cos, sin [N, head_dim]: rows rotate by the patch row, columns by its column."""
        positions = self._host(rotary_positions(grids, self.config.spatial_merge_size))
        freqs = positions[..., None].float() * self.inv_freq        # [N, 2, head_dim / 4]
        angles = freqs.reshape(freqs.shape[0], -1)                  # [h freqs | w freqs]
        angles = self.torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def encode(self, images: Sequence[Any]) -> list[Any]:
        """One [num_tokens, embed_width] tensor per image (num_tokens = patches / merge**2):
        the merged embeddings, then the DeepStack features in block order, side by side, so
        every slice of an image's rows carries its features (config.embed_width)."""
        grids = [tuple(int(g) for g in im.grid_thw) for im in images]
        torch = self.torch
        with torch.inference_mode():
            x = self._embed(images, grids)
            cos, sin = self._rotary(grids)
            cu = self._host(segment_bounds(grids))
            features = []
            for index, block in enumerate(self.blocks):
                x = self._block(block, x, cos, sin, cu)
                if index in self.deepstack:
                    features.append(self._merge(x, self.deepstack[index]))
            merged = self._merge(x, self.merger)
            if features:
                merged = torch.cat([merged, *features], dim=1)
        unit = self.config.spatial_merge_size ** 2
        return list(merged.split([t * h * w // unit for t, h, w in grids]))

    def _layer_norm(self, x: Any, norm: tuple) -> Any:
        return self.torch.nn.functional.layer_norm(x, (x.shape[-1],), norm[0], norm[1],
                                                   LAYER_NORM_EPS)

    def _rotate(self, x: Any, cos: Any, sin: Any, heads: int) -> Any:
        """x [N, H*D] -> rotated, in the tower dtype (the rotation itself in float32)."""
        xf = x.reshape(x.shape[0], heads, -1).float()
        half = xf.shape[-1] // 2
        turned = self.torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        out = xf * cos[:, None, :] + turned * sin[:, None, :]
        return out.to(self.dtype).reshape(x.shape[0], -1)

    def _block(self, b: VisionBlock, x: Any, cos: Any, sin: Any, cu: Any) -> Any:
        n, width = x.shape[0], b.heads * b.head_dim
        qkv = self._empty(n, 3 * width)
        b.qkv(qkv, self._layer_norm(x, b.norm1))
        q = self._rotate(qkv[:, :width], cos, sin, b.heads)
        k = self._rotate(qkv[:, width:2 * width], cos, sin, b.heads)
        attn = self._empty(n, width)
        self.attention(attn, q, k, qkv[:, 2 * width:], cu, b.heads, b.head_dim ** -0.5)
        out = self._empty(n, x.shape[1])
        b.proj(out, attn)
        x = x + out
        hidden = self._empty(n, b.fc1.out_features)
        b.fc1(hidden, self._layer_norm(x, b.norm2))
        hidden = self.torch.nn.functional.gelu(hidden, approximate="tanh" if b.tanh_gelu
                                               else "none")
        b.fc2(out, hidden)
        return x + out

    def _merge(self, x: Any, merger: PatchMerger) -> Any:
        unit = self.config.spatial_merge_size ** 2
        if merger.post_shuffle:
            h = self._layer_norm(x.reshape(-1, x.shape[1] * unit), merger.norm)
        else:
            h = self._layer_norm(x, merger.norm).reshape(-1, x.shape[1] * unit)
        mid = self._empty(h.shape[0], h.shape[1])
        merger.fc1(mid, h)
        mid = self.torch.nn.functional.gelu(mid)
        out = self._empty(h.shape[0], self.config.out_hidden_size)
        merger.fc2(out, mid)
        return out
