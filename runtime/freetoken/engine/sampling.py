"""Next-token sampling over a batch: temperature, top-k, top-p, per-request seeded generators.

Every row with temperature 0 is greedy (argmax). The others are filtered in one vectorized pass
over sorted candidates and drawn by inverse CDF with one uniform number from the row's own
torch.Generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from freetoken.engine.request import SamplingParams

# Above this k, a full sort is about as cheap as topk and simpler.
TOPK_FAST_PATH_LIMIT = 1024


def create_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: seeded when the request gives a seed, else from fresh entropy."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed if seed is not None else random.SystemRandom().getrandbits(63))
    return generator


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator]) -> list[int]:
    """One token id per row of `logits` [B, vocab] (float32, any device).

    params must be resolved (temperature, top_k, top_p set); generators are CPU generators.
    """
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:                    # all greedy: one argmax, no copies
        return greedy_tokens(logits)
    if len(rows) == len(params):    # none greedy: no argmax, no gather
        return _sample_rows(logits.float(), list(params), list(generators)).tolist()
    index = torch.tensor(rows, device=logits.device)
    chosen = _sample_rows(logits.index_select(0, index).float(),
                          [params[i] for i in rows], [generators[i] for i in rows])
    tokens = greedy_tokens(logits)
    for row, token in zip(rows, chosen.tolist()):
        tokens[row] = token
    return tokens


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Argmax per row (the first index on ties, as torch.argmax)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy's vectorized argmax: ~20x faster than torch's on CPU (5 vs 100 us per row
        # of a 49k vocabulary), which is per-step overhead of every batched decode.
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


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


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator]) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    values, ids = _candidates(logits / temps, params)
    width = values.shape[-1]
    ks = torch.tensor([p.top_k if p.top_k > 0 else width for p in params], device=device)
    rank = torch.arange(width, device=device)
    values = values.masked_fill(rank >= ks.unsqueeze(1), float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Nucleus: keep a token while the mass ranked before it is below top_p (the top one always).
    top_ps = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    if ids is not None:
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_ps, 0.0)
    cdf = probs.cumsum(dim=-1)
    uniforms = torch.cat([torch.rand(1, generator=g) for g in generators]).to(device)
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)
    picks = torch.searchsorted(cdf, targets, right=True).clamp_(max=width - 1)
    if ids is None:
        return picks.squeeze(1)
    return ids.gather(1, picks).squeeze(1)
