"""Presence and frequency penalties (OpenAI) and the repetition penalty (CTRL, as HF and vLLM
apply it) on the logits of one step, before sampling.

presence/frequency: logit[t] -= presence * (t was generated) + frequency * (times generated).
repetition: the logit of every token seen in the prompt or the output is divided by the penalty
when positive, multiplied when negative (applied first, as vLLM does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freetoken.arrays import is_torch
from freetoken.engine.request import Request


def apply_penalties(logits, requests: Sequence[Request]) -> None:
    """In place on float32 logits [B, V] (numpy, or torch on a GPU); row b is requests[b]'s.
    Rows of requests without penalties are untouched; the logits of a step are used only to
    sample, so no copy is kept."""
    for row, request in enumerate(requests):
        params = request.params
        if not params.has_penalties:
            continue
        if params.repetition_penalty != 1:
            seen = np.unique(np.asarray(request.token_ids, dtype=np.int64))
            _divide_by_penalty(logits, row, seen, params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            output = np.asarray(request.token_ids[request.prompt_len:], dtype=np.int64)
            ids, counts = np.unique(output, return_counts=True)
            if len(ids):
                delta = params.frequency_penalty * counts + params.presence_penalty
                _subtract(logits, row, ids, delta.astype(np.float32))


def _divide_by_penalty(logits, row: int, ids: np.ndarray, penalty: float) -> None:
    if is_torch(logits):
        import torch

        index = torch.from_numpy(ids).to(logits.device)
        values = logits[row, index]
        logits[row, index] = torch.where(values > 0, values / penalty, values * penalty)
    else:
        values = logits[row, ids]
        logits[row, ids] = np.where(values > 0, values / penalty, values * penalty)


def _subtract(logits, row: int, ids: np.ndarray, delta: np.ndarray) -> None:
    if is_torch(logits):
        import torch

        index = torch.from_numpy(ids).to(logits.device)
        logits[row, index] -= torch.from_numpy(delta).to(logits.device)
    else:
        logits[row, ids] -= delta
