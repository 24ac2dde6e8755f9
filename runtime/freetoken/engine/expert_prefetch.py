"""Predicting the next MoE layer's experts, so the expert cache can copy them ahead.

A decoder layer adds its attention and MLP outputs to the residual stream, which changes little
from one layer to the next; the next layer's router applied to this layer's (normed) MoE input
therefore picks most of the experts the next layer will route to. The prediction runs on the
GPU beside this layer's own routing (one small product and a top-k) and its ids reach the host
with this layer's ids, in the same sync; engine/expert_cache.py copies the predicted misses
behind this layer's own.
"""

from __future__ import annotations

from typing import Any


class NextLayerRouter:
    """predictor(x) -> int32 [T, K]: the top-K experts of the next MoE layer's router
    (`next_mlp.router(out, x)`, read at each call: a benchmark may swap it) for this layer's
    input x [T, H]. Buffers are kept per token count, so a CUDA graph that captured a
    prediction replays into the same memory."""

    def __init__(self, next_mlp: Any, num_experts: int, top_k: int):
        import torch

        self.torch, self.next_mlp = torch, next_mlp
        self.num_experts, self.top_k = num_experts, top_k
        self._buffers: dict[tuple[int, Any], tuple] = {}

    def __call__(self, x):
        key = (x.shape[0], x.device)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = self._alloc(x)
        logits, values, indices, ids = buffers
        self.next_mlp.router(logits, x)
        self.torch.topk(logits, self.top_k, dim=-1, out=(values, indices))
        ids.copy_(indices)
        return ids

    def _alloc(self, x) -> tuple:
        torch, tokens = self.torch, x.shape[0]
        # written in place in and out of inference mode (graph capture, eager steps)
        with torch.inference_mode(False):
            logits = torch.empty(tokens, self.num_experts, dtype=x.dtype, device=x.device)
            values = torch.empty(tokens, self.top_k, dtype=x.dtype, device=x.device)
            indices = torch.empty(tokens, self.top_k, dtype=torch.int64, device=x.device)
            ids = torch.empty(tokens, self.top_k, dtype=torch.int32, device=x.device)
        return logits, values, indices, ids


def next_layer_routers(layers: list, num_experts: int, top_k: int
                       ) -> list[NextLayerRouter | None]:
    """One predictor per MoE layer (MoEMLP blocks in order): layer l's predicts layer l + 1's
    experts with l + 1's router; the last layer has none."""
    predictors: list[NextLayerRouter | None] = [
        NextLayerRouter(nxt, num_experts, top_k) for nxt in layers[1:]]
    return predictors + [None]
