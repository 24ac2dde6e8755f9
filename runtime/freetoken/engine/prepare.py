"""Build the model's ForwardBatch (token ids, positions, paged-KV addressing) for one step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays
from freetoken.engine.scheduler import ScheduledChunk
from freetoken.models.batch import ForwardBatch


def prepare_forward_batch(plan: Sequence[ScheduledChunk], block_size: int,
                          arrays: HostArrays | TorchArrays,
                          with_states: bool = False) -> ForwardBatch:
    """Flatten the plan's chunks into one batch; sequence b's new tokens are its chunk.

    Token t at position p of a sequence with pages P is stored at slot
    P[p // block_size] * block_size + p % block_size.
    """
    # Two host arrays (int64 and int32 fields) and at most two copies to the device; every
    # field is a view of one of them.
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    tables: list[int] = []
    max_blocks = max(len(chunk.request.pages) for chunk in plan)
    for chunk in plan:
        request = chunk.request
        begin, end = request.num_computed, request.num_computed + chunk.num_tokens
        pages = request.pages
        input_ids += request.token_ids[begin:end]
        positions += range(begin, end)
        slots += [pages[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        seq_lens.append(end)
        starts.append(starts[-1] + chunk.num_tokens)
        tables += pages
        tables += [0] * (max_blocks - len(pages))
    num_tokens, num_seqs = len(input_ids), len(plan)
    wide = arrays.index(np.array(input_ids + positions + slots + [s - 1 for s in starts[1:]],
                                 dtype=np.int64))
    states = [chunk.request.state_slot for chunk in plan] if with_states else []
    narrow = arrays.index(np.array(tables + seq_lens + starts + states, dtype=np.int32))
    table_end = num_seqs * max_blocks
    return ForwardBatch(
        input_ids=wide[:num_tokens],
        positions=wide[num_tokens:2 * num_tokens],
        slot_mapping=wide[2 * num_tokens:3 * num_tokens],
        block_tables=narrow[:table_end].reshape(num_seqs, max_blocks),
        seq_lens=narrow[table_end:table_end + num_seqs],
        query_start_loc=narrow[table_end + num_seqs:table_end + 2 * num_seqs + 1],
        logits_indices=wide[3 * num_tokens:],
        max_query_len=max(chunk.num_tokens for chunk in plan),
        state_slots=narrow[table_end + 2 * num_seqs + 1:] if with_states else None,
    )
