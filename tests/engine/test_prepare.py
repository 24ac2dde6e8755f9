"""prepare_forward_batch against the batch layout written out from its definition, over steps
in which the requests' pages grow (appended to the same list) and are replaced (a preempted
request re-admitted with other pages), as the scheduler does between steps."""

from __future__ import annotations

import numpy as np

from freetoken.arrays import HostArrays
from freetoken.engine.prepare import prepare_forward_batch
from freetoken.engine.request import Request, SamplingParams
from freetoken.engine.scheduler import ScheduledChunk

BLOCK = 4


def _request(n_tokens: int, seed: int) -> Request:
    ids = np.random.default_rng(seed).integers(0, 1000, n_tokens).tolist()
    return Request(request_id=str(seed), prompt_len=n_tokens, token_ids=ids,
                   params=SamplingParams(), generator=None, detokenizer=None, sink=None)


def _expected(plan: list[ScheduledChunk]) -> dict[str, np.ndarray]:
    width = max(len(c.request.pages) for c in plan)
    out = {k: [] for k in ("input_ids", "positions", "slot_mapping", "logits_indices")}
    tables, lens, starts = [], [], [0]
    for c in plan:
        r = c.request
        for p in range(r.num_computed, r.num_computed + c.num_tokens):
            out["input_ids"].append(r.token_ids[p])
            out["positions"].append(p)
            out["slot_mapping"].append(r.pages[p // BLOCK] * BLOCK + p % BLOCK)
        tables.append(r.pages + [0] * (width - len(r.pages)))
        lens.append(r.num_computed + c.num_tokens)
        starts.append(starts[-1] + c.num_tokens)
        out["logits_indices"].append(starts[-1] - 1)
    out.update(block_tables=tables, seq_lens=lens, query_start_loc=starts)
    return {k: np.array(v) for k, v in out.items()}


def _check(plan: list[ScheduledChunk]) -> None:
    batch = prepare_forward_batch(plan, BLOCK, HostArrays())
    for name, want in _expected(plan).items():
        got = np.asarray(getattr(batch, name))
        assert got.shape == want.shape and (got == want).all(), (name, got, want)
    assert batch.max_query_len == max(c.num_tokens for c in plan)


def test_batches_follow_growing_and_replaced_pages():
    a, b, c = _request(10, 1), _request(3, 2), _request(30, 3)
    a.pages, b.pages, c.pages = [7, 2, 9], [4], [11, 12]
    _check([ScheduledChunk(a, 10), ScheduledChunk(b, 3), ScheduledChunk(c, 8)])  # prefills
    a.num_computed, b.num_computed, c.num_computed = 10, 3, 8
    for step in range(40):                        # decodes; c also prefills in chunks of 4
        for r in (a, b):
            r.token_ids.append(100 + step)
            if len(r.token_ids) > BLOCK * len(r.pages):
                r.pages.append(20 + 2 * step + (r is b))   # the same list, extended
        plan = [ScheduledChunk(a, 1), ScheduledChunk(b, 1)]
        if c.num_computed < len(c.token_ids):
            n = min(4, len(c.token_ids) - c.num_computed)
            while c.num_computed + n > BLOCK * len(c.pages):
                c.pages.append(200 + len(c.pages))
            plan.insert(1, ScheduledChunk(c, n))
        if step == 17:                            # b preempted, re-admitted on other pages
            b.pages = [90 + i for i in range(len(b.pages))]
        if step == 25:                            # and again, with fewer pages matched
            b.num_computed = len(b.token_ids) - 1
            b.pages = [60 + i for i in range(-(-len(b.token_ids) // BLOCK))]
        _check(plan)
        for chunk in plan:
            chunk.request.num_computed += chunk.num_tokens
