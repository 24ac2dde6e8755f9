import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.detokenizer import IncrementalDetokenizer
from freetoken.engine.kv_pool import PagePool
from freetoken.engine.request import Request, RequestStatus, SamplingParams
from freetoken.engine.scheduler import Scheduler
from tests.engine.fakes import CharTokenizer


def make_request(name: str, prompt_len: int, max_tokens: int = 100) -> Request:
    prompt = [1] * prompt_len
    return Request(name, prompt_len, list(prompt),
                   SamplingParams(max_tokens=max_tokens).resolve(None, max_tokens),
                   torch.Generator(), IncrementalDetokenizer(CharTokenizer(), prompt),
                   sink=lambda out: None)


def run_step(plan):
    """What the engine does after a forward: advance and sample one token where due."""
    for chunk in plan:
        done = chunk.completes_sequence
        chunk.request.num_computed += chunk.num_tokens
        if done:
            chunk.request.token_ids.append(3)


def make_scheduler(num_tokens=1024, block=16, seqs=8, chunk=64):
    config = EngineConfig(num_tokens=num_tokens, block_size=block, max_num_seqs=seqs,
                          max_prefill_tokens=chunk)
    return Scheduler(config, PagePool(config.num_blocks, block))


def test_long_prompt_is_prefilled_in_chunks():
    sched = make_scheduler(chunk=64)
    req = make_request("a", 150)
    sched.add(req)
    sizes = []
    for _ in range(3):
        plan = sched.schedule()
        sizes.append([c.num_tokens for c in plan])
        assert [c.completes_sequence for c in plan] == [len(sizes) == 3]
        run_step(plan)
    assert sizes == [[64], [64], [22]]
    assert req.num_output == 1 and req.num_pending == 1
    assert len(req.pages) == 10  # 150 computed tokens on 16-token pages


def test_prefill_budget_respected_each_step():
    sched = make_scheduler(chunk=40)
    for i in range(5):
        sched.add(make_request(f"r{i}", 30))
    for _ in range(10):
        plan = sched.schedule()
        prefill = sum(c.num_tokens for c in plan if c.request.num_pending > 1)
        assert prefill <= 40
        run_step(plan)
    assert all(r.num_output >= 1 for r in sched.running) and len(sched.running) == 5


def test_new_requests_join_while_others_decode():
    sched = make_scheduler(chunk=32)
    first = make_request("first", 20)
    sched.add(first)
    run_step(sched.schedule())              # first is prefilled, now decoding
    second = make_request("second", 20)
    sched.add(second)
    plan = sched.schedule()
    assert {(c.request.request_id, c.num_tokens) for c in plan} == {("first", 1), ("second", 20)}
    run_step(plan)
    plan = sched.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan] == [("first", 1), ("second", 1)]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(seqs=2, chunk=512)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4))
    plan = sched.schedule()
    assert len(plan) == 2 and len(sched.waiting) == 2


def test_admission_waits_for_free_pages():
    sched = make_scheduler(num_tokens=64, block=16, chunk=512)  # 4 pages
    big = make_request("big", 48)           # 3 pages
    sched.add(big)
    run_step(sched.schedule())
    small = make_request("small", 20)       # needs 2 pages (+1 spare for big): must wait
    sched.add(small)
    plan = sched.schedule()
    assert [c.request.request_id for c in plan] == ["big"]
    assert small.status is RequestStatus.WAITING and small.pages == []
    sched.finish(big)
    assert sched.pool.num_free == 4
    assert [c.request.request_id for c in sched.schedule()] == ["small"]


def test_full_pool_preempts_newest_and_recomputes_it_later():
    sched = make_scheduler(num_tokens=64, block=16, chunk=512)   # 4 pages
    old, new = make_request("old", 16), make_request("new", 15)
    sched.add(old)
    run_step(sched.schedule())
    sched.add(new)
    run_step(sched.schedule())   # new admitted: each now holds 1 full-ish page
    for _ in range(40):
        plan = sched.schedule()
        run_step(plan)
        sched.pool.check_integrity(sched.owned_pages())
    assert sched.num_preemptions >= 1
    assert old.status is RequestStatus.RUNNING
    # the preempted request keeps its generated tokens and recomputes them when readmitted
    assert new.num_output >= 1 and len(new.token_ids) == new.prompt_len + new.num_output


def test_finish_frees_pages_of_waiting_and_running():
    sched = make_scheduler(num_tokens=64, seqs=1)
    a, b = make_request("a", 10), make_request("b", 10)
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sched.finish(b)
    sched.finish(a)
    sched.finish(a)  # idempotent
    assert sched.pool.num_free == sched.pool.num_pages and not sched.has_work


def test_schedule_decodes_only_when_every_running_sequence_decodes():
    """The lookahead step (overlap scheduling): one token per running sequence, with a page
    for it; None while a prefill continues, a request could be admitted, or pages run out."""
    sched = make_scheduler(num_tokens=128, block=16, seqs=2, chunk=64)   # 8 pages
    a, b = make_request("a", 20), make_request("b", 80)
    sched.add(a)
    sched.add(b)
    run_step(sched.schedule())              # a whole, b's first 44 tokens
    assert sched.schedule_decodes() is None  # b still prefills
    run_step(sched.schedule())
    plan = sched.schedule_decodes()
    assert [(c.request, c.num_tokens) for c in plan] == [(a, 1), (b, 1)]
    assert len(a.pages) == 2 and len(b.pages) == 6   # room for token 21 / 81 (81 > 5 pages)
    run_step(plan)
    c = make_request("c", 4)
    sched.add(c)                             # waiting, but both slots taken: still decodes
    assert sched.schedule_decodes() is not None
    sched.finish(a)                          # a slot opens: c is admitted by schedule()
    assert sched.schedule_decodes() is None
    run_step(sched.schedule())
    sched.finish(c)
    b.token_ids += [3] * (144 - len(b.token_ids))   # b's next token needs 9 pages: 6 + 2 free
    b.num_computed = len(b.token_ids) - 1
    assert sched.schedule_decodes() is None
    assert sched.num_preemptions == 0 and len(b.pages) == 6 and sched.pool.num_free == 2


class RecordingSnapshots:
    """StateSnapshots' scheduler-facing calls, recorded (rows handed out in order)."""

    def __init__(self):
        self.calls, self.rows = [], 0

    def stage(self, slot, replaces=None):
        self.rows += 1
        self.calls.append(("stage", self.rows - 1))
        return self.rows - 1

    def commit(self, key, row):
        self.calls.append(("commit", row))

    def discard(self, row):
        self.calls.append(("discard", row))

    def save(self, key, slot, replaces=None):
        self.calls.append(("save", None))

    def touch(self, key):
        return False


def test_overlapped_snapshots_are_staged_before_the_next_step_and_never_leak():
    """A hybrid request's state snapshot due after the running step is copied by
    schedule_decodes (before the next step is launched) and keyed when that step is
    published; a request that ends or is preempted in between gives its row back."""
    config = EngineConfig(num_tokens=256, block_size=16, max_num_seqs=2, max_prefill_tokens=64,
                          prefix_cache=True)
    sched = Scheduler(config, PagePool(config.num_blocks, 16))
    sched.snapshots = snaps = RecordingSnapshots()
    a = make_request("a", 20)
    sched.add(a)
    run_step(sched.schedule())            # the prompt up to its snapshot point (16)
    sched.publish(a)
    assert snaps.calls == [("save", None)]
    run_step(sched.schedule())            # the rest of the prompt: 20 computed
    sched.publish(a)
    while a.num_computed < 32:            # decode up to the next page boundary
        run_step(sched.schedule_decodes())
        sched.publish(a, num_known=a.num_computed - 1)
    assert snaps.calls == [("save", None)]
    plan = sched.schedule_decodes()       # 32 computed: a snapshot is due, staged now
    assert snaps.calls[-1] == ("stage", 0) and a.staged_snapshot == (32, 0)
    run_step(plan)                        # the next step was launched (33 computed)
    sched.publish(a, num_known=32)        # publishing the step that reached 32 keys the row
    assert snaps.calls[-1] == ("commit", 0) and a.staged_snapshot is None
    while a.num_computed < 48:
        run_step(sched.schedule_decodes())
        sched.publish(a, num_known=a.num_computed - 1)
    sched.schedule_decodes()              # due at 48: staged, then the request ends
    assert a.staged_snapshot == (48, 1)
    sched.finish(a)
    assert snaps.calls[-1] == ("discard", 1) and a.staged_snapshot is None


def test_waiting_requests_keep_their_snapshots_from_eviction_by_earlier_admissions():
    """Two conversations repeated at once on one state slot: the second waits while the
    first runs, and the first's new end-of-turn snapshot evicts the least recently used one.
    The waiting request's snapshot counts as used from its arrival, so a stale end-of-turn
    snapshot goes instead and both repeats resume from their prompts' snapshots."""
    from freetoken.arrays import HostArrays
    from freetoken.engine.state_pool import StateSlots
    from freetoken.engine.state_snapshots import StateSnapshots
    from tests.engine.test_state_pool import FakeKV

    config = EngineConfig(num_tokens=512, block_size=16, max_num_seqs=1, max_prefill_tokens=64,
                          prefix_cache=True)
    sched = Scheduler(config, PagePool(config.num_blocks, 16), "m", StateSlots(1, 1))
    sched.snapshots = snaps = StateSnapshots(FakeKV(1), [0, 2], capacity=3, arrays=HostArrays())

    def request(name, first, max_tokens=12):
        prompt = list(range(first, first + 40))   # snapshot point 32
        return Request(name, len(prompt), list(prompt),
                       SamplingParams(max_tokens=max_tokens).resolve(None, max_tokens),
                       torch.Generator(),
                       IncrementalDetokenizer(CharTokenizer(), prompt), sink=lambda out: None)

    def serve(requests):
        for r in requests:
            sched.add(r)
        while sched.has_work:
            run_step(plan := sched.schedule())
            for chunk in plan:
                sched.publish(chunk.request)
                if chunk.request.num_output == chunk.request.params.max_tokens:
                    sched.finish(chunk.request)

    serve([request("b", 500)])       # 51 computed: snapshots at 32 (prompt) and 48 (turn end)
    serve([request("a", 100, max_tokens=4)])   # 43 computed: a snapshot at 32 only
    assert snaps.stats()["state_snapshots"] == 3   # least recently used first: b 32, b 48, a 32
    again = [request("a2", 100), request("b2", 500)]
    hits = sched.cache_hit_tokens
    serve(again)                     # a2 runs first and snapshots a new page at 48: one row goes
    assert [r.cached_tokens for r in again] == [32, 32]
    assert sched.cache_hit_tokens - hits == 64 and snaps.num_restored == 2
