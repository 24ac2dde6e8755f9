"""Log-probabilities of sampled tokens and their most likely alternatives, from the raw logits
(before temperature and penalties, as OpenAI and vLLM report them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freetoken.arrays import is_torch
from freetoken.engine.request import TokenLogprob


def log_softmax_rows(logits, rows: Sequence[int]) -> np.ndarray:
    """float32 [len(rows), V] host copy of log_softmax over the chosen rows of the logits."""
    if is_torch(logits):
        import torch

        index = torch.tensor(list(rows), device=logits.device)
        return torch.log_softmax(logits.index_select(0, index).float(), dim=-1).cpu().numpy()
    picked = logits[list(rows)].astype(np.float32)
    peak = picked.max(axis=-1, keepdims=True)
    total = np.log(np.exp(picked - peak).sum(axis=-1, keepdims=True))
    return picked - peak - total


def token_logprob(row: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The entry for `token` from one row of log-probabilities, with `top` alternatives."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(-row, top - 1)[:top] if top < row.shape[0] else np.arange(top)
        ids = ids[np.argsort(-row[ids], kind="stable")]
        alternatives = tuple((int(i), float(row[i])) for i in ids)
    return TokenLogprob(int(token), float(row[token]), alternatives)
