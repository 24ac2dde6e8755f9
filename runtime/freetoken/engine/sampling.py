"""Next-token sampling over a batch: temperature, top-k, top-p, per-request seeded generators.

Every row with temperature 0 is greedy (argmax). The others keep the top_k most likely tokens,
then the smallest set whose probability reaches top_p, and draw by inverse CDF with one uniform
number from the request's own generator, so a seeded request samples the same tokens whatever
else is in the batch. CPU logits (numpy) are sampled here; GPU logits in ``sampling_torch``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from freetoken.arrays import is_torch
from freetoken.engine.request import SamplingParams

# Nucleus sampling first looks at this many of the most likely tokens; only when they hold
# less than top_p of the mass does it sort the whole vocabulary.
NUCLEUS_CANDIDATES = 1024


def create_generator(seed: int | None) -> np.random.Generator:
    """Seeded when the request gives a seed, else from fresh entropy."""
    return np.random.default_rng(seed if seed is not None
                                 else random.SystemRandom().getrandbits(63))


def sample_tokens(logits, params: Sequence[SamplingParams],
                  generators: Sequence[np.random.Generator]) -> list[int]:
    """One token id per row of float32 `logits` [B, vocab] (numpy, or torch on a GPU).

    params must be resolved (temperature, top_k, top_p set).
    """
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return greedy_tokens(logits)
    uniforms = [generators[i].random() for i in rows]
    chosen_params = [params[i] for i in rows]
    if is_torch(logits):
        return _sample_torch(logits, rows, chosen_params, uniforms).tolist()
    tokens = greedy_tokens(logits) if len(rows) < len(params) else [0] * len(params)
    chosen = [sample_row(logits[i], p, u) for i, p, u in zip(rows, chosen_params, uniforms)]
    for row, token in zip(rows, chosen):
        tokens[row] = token
    return tokens


def sample_on_device(logits, params: Sequence[SamplingParams],
                     generators: Sequence[np.random.Generator]):
    """sample_tokens without reading the ids back: an int64 array on the logits' device (the
    same draws from the same generators, so the tokens are the same)."""
    if not is_torch(logits):
        return np.asarray(sample_tokens(logits, params, generators), dtype=np.int64)
    rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not rows:
        return logits.argmax(-1)
    uniforms = [generators[i].random() for i in rows]
    return _sample_torch(logits, rows, [params[i] for i in rows], uniforms)


def _sample_torch(logits, rows: list[int], params: list[SamplingParams], uniforms: list[float]):
    """Sampled rows and the greedy rest, combined on the device (one read-back per step)."""
    import torch

    from freetoken.engine.sampling_torch import sample_rows

    if len(rows) == logits.shape[0]:
        return sample_rows(logits.float(), params, uniforms)
    tokens = logits.argmax(-1)
    # non_blocking: a blocking host-to-device copy would wait for every step in flight
    index = torch.tensor(rows, dtype=tokens.dtype).to(logits.device, non_blocking=True)
    tokens[index] = sample_rows(logits[index].float(), params, uniforms)
    return tokens


def greedy_tokens(logits) -> list[int]:
    """Argmax per row (the first index on ties)."""
    return logits.argmax(-1).tolist()


def sample_row(logits: np.ndarray, p: SamplingParams, uniform: float) -> int:
    """One token from one row of float32 logits."""
    return draw_candidates(*row_candidates(logits, p), uniform)


def row_candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, unnormalised weights) of the tokens one row of float32 logits may give under
    temperature, top-k and top-p: the distribution sample_row draws from."""
    scaled = logits.astype(np.float64) / p.temperature
    vocab = scaled.shape[0]
    k = p.top_k if 0 < p.top_k < vocab else vocab
    if k == vocab and p.top_p >= 1.0:       # plain temperature: no order needed
        return np.arange(vocab), np.exp(scaled - scaled.max())
    ids = _top(scaled, k if p.top_p >= 1.0 else min(k, NUCLEUS_CANDIDATES))
    weights = np.exp(scaled[ids] - scaled[ids[0]])
    if p.top_p < 1.0:
        # probabilities are normalised over the top-k tokens
        total = weights.sum() if len(ids) == k else _top_mass(scaled, k, scaled[ids[0]])
        if len(ids) < k and weights.sum() < p.top_p * total:
            ids = _top(scaled, k)           # the nucleus reaches past the first candidates
            weights = np.exp(scaled[ids] - scaled[ids[0]])
        mass_before = (np.cumsum(weights) - weights) / total
        weights = np.where(mass_before < p.top_p, weights, 0.0)   # the top token always stays
    return ids, weights


def _top(scaled: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest values, largest first."""
    ids = (np.argpartition(-scaled, n - 1)[:n] if n < scaled.shape[0]
           else np.arange(scaled.shape[0]))
    return ids[np.argsort(-scaled[ids], kind="stable")]


def _top_mass(scaled: np.ndarray, k: int, peak: float) -> float:
    """Sum of exp(value - peak) over the k largest values."""
    top = scaled if k >= scaled.shape[0] else np.partition(scaled, scaled.shape[0] - k)[-k:]
    return float(np.exp(top - peak).sum())


def draw_candidates(ids: np.ndarray, weights: np.ndarray, uniform: float) -> int:
    """The token at `uniform` (in [0, 1)) of the weights' cumulative distribution."""
    cdf = np.cumsum(weights)
    pick = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    return int(ids[min(pick, len(ids) - 1)])
