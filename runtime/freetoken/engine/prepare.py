"""Build the model's ForwardBatch (token ids, positions, paged-KV addressing) for one step."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from freetoken.arrays import HostArrays, TorchArrays
from freetoken.engine.request import Request
from freetoken.engine.scheduler import ScheduledChunk
from freetoken.models.batch import ForwardBatch, MultimodalBatch


def prepare_forward_batch(plan: Sequence[ScheduledChunk], block_size: int,
                          arrays: HostArrays | TorchArrays,
                          with_states: bool = False, rope_spare: int = 0) -> ForwardBatch:
    """Flatten the plan's chunks into one batch; sequence b's new tokens are its chunk.

    Token t at position p of a sequence with pages P is stored at slot
    P[p // block_size] * block_size + p % block_size. A request with images takes its
    rotary positions from its layout (engine/multimodal.py); its image tokens point at the
    rotary table's spare rows from `rope_spare` on.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    mm_rows: list = []      # (t, h, w) of the step's image tokens
    mm_pieces: list = []
    for chunk in plan:
        request = chunk.request
        begin, end = request.num_computed, request.num_computed + chunk.num_tokens
        pages = request.pages
        input_ids += request.token_ids[begin:end - len(chunk.draft)]
        input_ids += chunk.draft
        if request.mm is None:
            positions += range(begin, end)
        else:
            row = len(positions)
            positions += request.mm.chunk_positions(begin, end, rope_spare, mm_rows)
            mm_pieces += [(row + at, request.mm, image, first, count)
                          for image, first, count, at in request.mm.pieces(begin, end)]
        slots += [pages[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        seq_lens.append(end)
        starts.append(starts[-1] + chunk.num_tokens)
    # logits of each sequence's last token; of every token of a chunk with drafts
    rows = [s - 1 for s in starts[1:]]
    if any(chunk.draft for chunk in plan):
        rows = [r for b, chunk in enumerate(plan)
                for r in (range(starts[b], starts[b + 1]) if chunk.draft else (rows[b],))]
    return pack_batch([chunk.request for chunk in plan], input_ids, positions, slots, seq_lens,
                      starts, rows, arrays,
                      [chunk.request.state_slot for chunk in plan] if with_states else None,
                      None if not mm_pieces else MultimodalBatch(
                          np.array(mm_rows, dtype=np.int64).reshape(-1, 3), mm_pieces))


def pack_batch(requests: Sequence[Request], input_ids: list[int], positions: list[int],
               slots: list[int], seq_lens: list[int], starts: list[int], rows: list[int],
               arrays: HostArrays | TorchArrays, state_slots: list[int] | None = None,
               multimodal: MultimodalBatch | None = None) -> ForwardBatch:
    """A ForwardBatch from its host lists: sequence b (its pages those of requests[b]) owns
    tokens starts[b]:starts[b+1]; `rows` are the token rows whose logits are returned.

    Two host arrays (int64 and int32 fields) and at most two copies to the device; every
    field is a view of one of them. The block table is filled from each request's int32
    copy of its pages (page_rows), extended as pages are added: converting every page id
    from Python on every step would cost ~40 ns each (8k ids at batch 32, 4k tokens)."""
    num_seqs, num_tokens = len(requests), len(input_ids)
    max_blocks = max(len(request.pages) for request in requests)
    table_end = num_seqs * max_blocks
    narrow = np.zeros(table_end + 2 * num_seqs + 1 + (num_seqs if state_slots else 0),
                      dtype=np.int32)
    tables = narrow[:table_end].reshape(num_seqs, max_blocks)
    for b, request in enumerate(requests):
        tables[b, :len(request.pages)] = page_rows(request)
    narrow[table_end:table_end + 2 * num_seqs + 1] = seq_lens + starts
    if state_slots:
        narrow[table_end + 2 * num_seqs + 1:] = state_slots
    wide = arrays.index(np.array(input_ids + positions + slots + rows, dtype=np.int64))
    narrow = arrays.index(narrow)
    return ForwardBatch(
        input_ids=wide[:num_tokens],
        positions=wide[num_tokens:2 * num_tokens],
        slot_mapping=wide[2 * num_tokens:3 * num_tokens],
        block_tables=narrow[:table_end].reshape(num_seqs, max_blocks),
        seq_lens=narrow[table_end:table_end + num_seqs],
        query_start_loc=narrow[table_end + num_seqs:table_end + 2 * num_seqs + 1],
        logits_indices=wide[3 * num_tokens:],
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        state_slots=narrow[table_end + 2 * num_seqs + 1:] if state_slots else None,
        multimodal=multimodal)


def page_rows(request: Request) -> np.ndarray:
    """request.pages as int32 (a view of the copy kept on the request), copying only the
    pages added since the last call; a replaced pages list starts a new copy."""
    pages, n = request.pages, len(request.pages)
    kept = request.page_rows
    if kept is None or kept[0] is not pages or kept[2] > n:
        kept = (pages, np.empty(max(n, 16), dtype=np.int32), 0)
    _, rows, done = kept
    if n > rows.shape[0]:
        grown = np.empty(max(n, 2 * rows.shape[0]), dtype=np.int32)
        grown[:done] = rows[:done]
        rows = grown
    if n > done:
        rows[done:n] = pages[done:n]
    request.page_rows = (pages, rows, n)
    return rows[:n]
