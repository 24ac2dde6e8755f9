"""The MTP block's graph step (engine/mtp_graphs.py) against its eager step (engine/
mtp_drafts.py), on the CPU: a recording block stands for the model. The padded inputs a graph
replays give the eager step's drafts and store the eager step's K/V (same slots, same
positions, same tokens), the padding stores nothing and reads only positions already stored,
and when the pool runs short some sequences draft fewer tokens. The replay itself runs
on a GPU (tests/engine/test_speculative_gpu.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from freetoken.arrays import HostArrays
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.mtp_drafts import BlockRows, MTPDrafts, draft_depths
from freetoken.engine.mtp_graphs import fits_graph, graph_step_inputs, new_rows
from freetoken.models.batch import ForwardBatch

VOCAB, HIDDEN, BLOCK = 97, 4, 4


class RecordingBlock:
    """A block whose next token is a function of the row's input token, position and hidden
    state, and whose 'K/V' records (position, token, hidden) by slot."""

    def __init__(self):
        self.arrays = HostArrays()

    def create_kv_cache(self, num_blocks, block_size, dtype=None):
        return {}

    def forward(self, batch: ForwardBatch, hidden, kv, step=0):
        for slot, position, token, h in zip(batch.slot_mapping, batch.positions,
                                            batch.input_ids, hidden):
            if slot >= 0:
                kv[int(slot)] = (int(position), int(token), float(h[0]))
        out = np.stack([np.full(HIDDEN, (int(t) * 31 + int(p) * 7 + float(h[0])) % 1013)
                        for t, p, h in zip(batch.input_ids, batch.positions, hidden)])
        rows = out[np.asarray(batch.logits_indices)]
        logits = np.zeros((len(rows), VOCAB), dtype=np.float32)
        logits[np.arange(len(rows)), rows[:, 0].astype(np.int64) % VOCAB] = 1.0
        return logits, rows


def drafts_engine(k, num_pages):
    model = SimpleNamespace(mtp=RecordingBlock(), arrays=HostArrays(), last_hidden=None)
    return MTPDrafts(model, num_pages, BLOCK, "float32", k), PagePool(num_pages, BLOCK)


def scene(k, counts, ends, pool, seed=0):
    """Parts of requests with `ends` computed tokens whose last `counts` are new; the target's
    hidden rows are random; every request holds the pages of its computed tokens."""
    rng = np.random.default_rng(seed)
    parts, row = [], 0
    for count, end in zip(counts, ends):
        request = SimpleNamespace(token_ids=rng.integers(3, VOCAB, end + 1).tolist(), pages=[],
                                  num_computed=end, page_rows=None, mm=None,
                                  draft_state=SimpleNamespace(mtp_draft=()))
        assert pool.extend(request.pages, end)
        parts.append(BlockRows(request, end - count, count, range(row, row + count)))
        row += count
    return parts, rng.normal(size=(row, HIDDEN)).astype(np.float32)


def replay_on_host(block, kv, inputs, parts, hidden, k):
    """What a graph computes, from graph_step_inputs and the loaded hidden rows."""
    rows = k + 1
    size = inputs.size
    padded = np.zeros((size * rows, HIDDEN), dtype=np.float32)
    padded[new_rows(parts, k)] = hidden
    batch = ForwardBatch(inputs.input_ids, inputs.positions, inputs.slots, None,
                         inputs.seq_lens, np.arange(0, size * rows + 1, rows),
                         np.arange(rows - 1, size * rows, rows), max_query_len=rows)
    logits, out = block.forward(batch, padded, kv)
    drafts = [logits.argmax(-1)]
    for d in range(1, k):
        step = ForwardBatch(drafts[-1], inputs.draft_positions[d - 1], inputs.draft_slots[d - 1],
                            None, inputs.draft_seq_lens[d - 1], np.arange(size + 1),
                            np.arange(size), max_query_len=1)
        logits, out = block.forward(step, out, kv, step=d)
        drafts.append(logits.argmax(-1))
    return np.stack(drafts, axis=1)


@pytest.mark.parametrize("k,counts,ends,num_pages", [
    (2, [1, 3, 2], [9, 14, 3], 64),
    (3, [4, 1], [30, 4], 64),
    (4, [5, 2, 1, 3, 5], [40, 17, 8, 12, 5], 64),
    (1, [2, 1], [7, 2], 64),
    (3, [2, 1, 3], [8, 12, 7], 8),      # the pool runs short: some drafts stop early
])
def test_graph_inputs_give_the_eager_steps_drafts_and_kv(k, counts, ends, num_pages):
    eager, eager_pool = drafts_engine(k, num_pages)
    graph, graph_pool = drafts_engine(k, num_pages)
    parts_e, hidden = scene(k, counts, ends, eager_pool)
    parts_g, _ = scene(k, counts, ends, graph_pool)
    chosen = sorted(set(range(0, len(parts_e), 2)) | {len(parts_e) - 1})
    drafting = [parts_e[i].request for i in chosen]
    drafting_g = {id(parts_g[i].request) for i in chosen}
    # earlier positions the block stored before this step: both pools alike
    for drafts, parts in ((eager, parts_e), (graph, parts_g)):
        for part in parts:
            for p in range(part.start):
                drafts.kv[drafts._slot(part.request, p)] = ("before", p)
    before = dict(graph.kv)

    eager.step(parts_e, hidden, eager_pool, drafting)

    assert fits_graph(parts_g, k, 16, 64, BLOCK)
    depths = draft_depths(parts_g, drafting_g, k, graph_pool)
    inputs = graph_step_inputs(parts_g, depths, k, len(parts_g) + 1, graph._slot)  # + padding
    got = replay_on_host(graph.block, graph.kv, inputs, parts_g, hidden, k)

    for part_e, part_g, depth, row in zip(parts_e, parts_g, depths, got):
        assert part_g.request.pages == part_e.request.pages
        assert tuple(row[:depth].tolist()) == part_e.request.draft_state.mtp_draft
        assert depth == len(part_e.request.draft_state.mtp_draft)
    assert graph.kv == eager.kv            # same slots written with the same values
    if num_pages < 64:
        assert 0 < min(d for d in depths if d) < k
    # the padding wrote nothing over what the block stored before, and reads only what exists
    assert all(graph.kv[slot] == value for slot, value in before.items())
    rows = k + 1
    for b, part in enumerate(parts_g):
        end = part.start + part.count
        assert inputs.seq_lens[b] == end
        pad = inputs.slots[b * rows:b * rows + rows - part.count]
        assert (pad == -1).all()
        assert (inputs.positions[b * rows:(b + 1) * rows] == np.arange(end - rows, end)).all()
        dropped = inputs.draft_slots[:, b] == -1
        assert (inputs.draft_seq_lens[dropped, b] == end).all()
    assert (inputs.slots[len(parts_g) * rows:] == -1).all()
    assert (inputs.draft_slots[:, len(parts_g):] == -1).all()


def test_only_decode_and_verify_steps_that_fit_take_a_graph():
    pool = PagePool(64, BLOCK)
    parts, _ = scene(2, [1, 3], [9, 14], pool)
    assert fits_graph(parts, 2, 16, 64, BLOCK)
    assert not fits_graph(parts, 1, 16, 64, BLOCK)          # 3 new positions > K + 1
    assert not fits_graph(parts, 2, 1, 64, BLOCK)           # more sequences than graphs
    assert fits_graph(parts, 2, 16, 4, BLOCK)               # 14 + 2 tokens: 4 pages
    assert not fits_graph(parts, 2, 16, 3, BLOCK)
    short, _ = scene(3, [2], [3], pool)
    assert not fits_graph(short, 3, 16, 64, BLOCK)          # no earlier positions to pad with
    assert not fits_graph([], 2, 16, 64, BLOCK)
