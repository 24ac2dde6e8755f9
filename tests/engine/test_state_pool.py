"""The recurrent-state slot allocator and the bounded snapshot store, on host arrays."""

import numpy as np
import pytest

from freetoken.arrays import HostArrays
from freetoken.engine.state_pool import StateSlots
from freetoken.engine.state_snapshots import StateSnapshots


class FakeKV:
    """Two GDN layers (0 and 2) between which layer 1 keeps K/V (never touched here)."""

    def __init__(self, slots):
        self.k = [np.zeros((slots, 3, 2), np.float32), None, np.zeros((slots, 3, 2), np.float32)]
        self.v = [np.zeros((slots, 2, 2, 2), np.float32), None,
                  np.zeros((slots, 2, 2, 2), np.float32)]


def test_slots_are_handed_out_once_and_returned():
    slots = StateSlots(2, bytes_per_slot=100)
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {0, 1} and slots.num_used == 2
    with pytest.raises(RuntimeError, match="all 2"):
        slots.allocate()
    slots.free(a)
    with pytest.raises(RuntimeError, match="twice"):
        slots.free(a)
    assert slots.allocate() == a
    assert slots.stats()["state_bytes_total"] == 200


def test_snapshots_copy_states_and_evict_the_least_recently_used():
    kv = FakeKV(2)
    store = StateSnapshots(kv, [0, 2], capacity=2, arrays=HostArrays())
    for i, key in enumerate((b"a", b"b")):
        kv.k[0][0], kv.v[2][0] = i + 1, 10 * (i + 1)
        store.save(key, 0)
    store.restore(b"a", 1)                  # a becomes the most recently used
    assert kv.k[0][1].max() == 1 and kv.v[2][1].max() == 10
    kv.k[0][0] = 3
    store.save(b"c", 0)                     # evicts b, the least recently used
    assert store.has(b"a") and store.has(b"c") and not store.has(b"b")
    kv.k[0][0] = 0                          # a snapshot is a copy, not a view
    store.restore(b"c", 1)
    assert kv.k[0][1].max() == 3
    assert store.stats()["state_snapshots"] == 2
    assert store.stats()["state_snapshot_bytes"] == 2 * 2 * (3 * 2 + 8) * 4


def test_a_moving_snapshot_reuses_its_row_and_leaves_the_others():
    kv = FakeKV(1)
    store = StateSnapshots(kv, [0, 2], capacity=3, arrays=HostArrays())
    kv.k[0][0] = 1
    store.save(b"prompt", 0)
    for i, key in enumerate((b"p1", b"p2", b"p3")):
        kv.k[0][0] = 10 + i
        store.save(key, 0, replaces=None if i == 0 else (b"p1", b"p2")[i - 1])
    assert store.has(b"prompt") and store.has(b"p3")
    assert not store.has(b"p1") and not store.has(b"p2")
    assert store.stats()["state_snapshots"] == 2      # one row moved forward, one row free
    store.restore(b"p3", 0)
    assert kv.k[0][0].max() == 12
    store.save(b"p4", 0, replaces=b"gone")            # its row was evicted: a fresh row
    assert store.has(b"p3") and store.has(b"p4") and store.has(b"prompt")


def test_a_staged_snapshot_holds_the_states_of_when_it_was_staged():
    """Overlap scheduling copies the states before the next step and keys them later: the
    row holds the states at staging, a key already stored keeps its row (the staged one goes
    back), and discarded rows are reused, so staging never leaks the store's capacity."""
    kv = FakeKV(1)
    store = StateSnapshots(kv, [0, 2], capacity=2, arrays=HostArrays())
    kv.k[0][0] = 1
    row = store.stage(0)
    kv.k[0][0] = 2                          # the next step moves the states on
    store.commit(b"a", row)
    store.restore(b"a", 0)
    assert kv.k[0][0].max() == 1
    store.commit(b"a", store.stage(0))      # already stored: the new row is freed
    assert store.stats()["state_snapshots"] == 1
    for _ in range(5):
        store.discard(store.stage(0))
    kv.k[0][0] = 7
    store.commit(b"b", store.stage(0))
    assert store.has(b"a") and store.has(b"b")  # a free row was left for b: nothing evicted
    store.restore(b"b", 0)
    assert kv.k[0][0].max() == 7
