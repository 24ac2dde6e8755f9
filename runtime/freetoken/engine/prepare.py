"""Build the model's ForwardBatch (token ids, positions, paged-KV addressing) for one step."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from freetoken.engine.scheduler import ScheduledChunk
from freetoken.models.batch import ForwardBatch


def prepare_forward_batch(plan: Sequence[ScheduledChunk], block_size: int,
                          device: torch.device | str) -> ForwardBatch:
    """Flatten the plan's chunks into one batch; sequence b's new tokens are its chunk.

    Token t at position p of a sequence with pages P is stored at slot
    P[p // block_size] * block_size + p % block_size.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    max_blocks = max(len(chunk.request.pages) for chunk in plan)
    tables = torch.zeros((len(plan), max_blocks), dtype=torch.int32)
    for row, chunk in enumerate(plan):
        request = chunk.request
        begin, end = request.num_computed, request.num_computed + chunk.num_tokens
        pages = request.pages
        input_ids.extend(request.token_ids[begin:end])
        positions.extend(range(begin, end))
        slots.extend(pages[p // block_size] * block_size + p % block_size
                     for p in range(begin, end))
        seq_lens.append(end)
        starts.append(starts[-1] + chunk.num_tokens)
        tables[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        positions=torch.tensor(positions, dtype=torch.int64).to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        query_start_loc=query_start_loc.to(device),
        logits_indices=(query_start_loc[1:].to(torch.int64) - 1).to(device),
        max_query_len=max(chunk.num_tokens for chunk in plan),
    )
