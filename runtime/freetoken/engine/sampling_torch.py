"""Sampling rows of GPU logits with torch: one vectorized pass over sorted candidates."""

from __future__ import annotations

import torch

from freetoken.engine.request import SamplingParams

# Above this k, a full sort is about as cheap as topk and simpler.
TOPK_FAST_PATH_LIMIT = 1024


def _candidates(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor,
                                                                            torch.Tensor | None]:
    """(values, token ids) in descending order, only the top max(k) when every row sets k;
    plain temperature sampling needs no order at all (ids None: position = token id)."""
    top_ks = [p.top_k for p in params]
    if all(k == 0 and p.top_p >= 1.0 for k, p in zip(top_ks, params)):
        return logits, None
    if all(0 < k <= TOPK_FAST_PATH_LIMIT for k in top_ks):
        return torch.topk(logits, min(max(top_ks), logits.shape[-1]), dim=-1, sorted=True)
    return torch.sort(logits, dim=-1, descending=True)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                uniforms: list[float]) -> torch.Tensor:
    """One token id per row of float32 logits on the GPU; uniforms[i] in [0, 1) drives row i."""
    device = logits.device
    temps = _to(device, [p.temperature for p in params], torch.float32).unsqueeze(1)
    values, ids = _candidates(logits / temps, params)
    width = values.shape[-1]
    ks = _to(device, [p.top_k if p.top_k > 0 else width for p in params], torch.int64)
    rank = torch.arange(width, device=device)
    values = values.masked_fill(rank >= ks.unsqueeze(1), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Nucleus: keep a token while the mass ranked before it is below top_p (the top one always).
    top_ps = _to(device, [p.top_p for p in params], torch.float32).unsqueeze(1)
    if ids is not None:
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_ps, 0.0)
    cdf = probs.cumsum(dim=-1)
    draws = _to(device, uniforms, torch.float32)
    targets = (draws * cdf[:, -1]).unsqueeze(1)
    picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=width - 1)
    if ids is None:
        return picks.squeeze(1)
    return ids.gather(1, picks).squeeze(1)


def _to(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """Host values on the device without waiting: a blocking copy would first wait for every
    step already queued on the stream (overlap scheduling keeps one queued)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
