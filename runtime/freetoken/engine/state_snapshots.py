"""Recurrent-state snapshots: what lets a hybrid model reuse the prefix cache.

A Gated DeltaNet layer's state after n tokens cannot be rebuilt from cached KV pages, and it
cannot be rewound. So the engine copies a sequence's states (every GDN layer's conv and
delta-rule state) at the page boundaries it is most likely to be resumed from, keyed by that
page's prefix-cache key: the last full page of the prompt (a retry or an edited last message
repeats it) and the last full page the generated tokens reach (an agent's next turn repeats
prompt and answer and appends to them; that one moves forward page by page while the request
decodes, so a request holds one such row at a time). A later request whose cached prefix
reaches a snapshot starts there: its slot gets the snapshot's states and only the tokens after
it are computed. A prefix that reaches no snapshot is recomputed from the start. The store is
bounded; the least recently used snapshot goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

# Snapshots kept per state slot (hybrid models with the prefix cache on): room for the latest
# turn of every running conversation and one as many again. The memory plan counts them.
SNAPSHOTS_PER_SLOT = 2


class StateSnapshots:
    """`capacity` snapshots in arrays beside the KV cache's state slots (same device/dtypes).

    kv: the KVCache whose GDN layers' k (conv) / v (delta-rule) entries hold the live states.
    Not thread-safe: called by the scheduler under the engine lock, in the engine thread, so
    copies are ordered with the forward steps around them.
    """

    def __init__(self, kv: Any, layers: list[int], capacity: int, arrays: Any):
        self.kv, self.layers, self.capacity = kv, layers, capacity
        self._conv = [arrays.empty((capacity,) + tuple(kv.k[i].shape[1:]),
                                   _dtype_name(kv.k[i])) for i in layers]
        self._ssm = [arrays.empty((capacity,) + tuple(kv.v[i].shape[1:]), "float32")
                     for i in layers]
        self._index: OrderedDict[bytes, int] = OrderedDict()   # key -> row; LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self.num_saved = self.num_restored = 0
        self.bytes_total = sum(_nbytes(a) for a in self._conv + self._ssm)

    def has(self, key: bytes) -> bool:
        return key in self._index

    def touch(self, key: bytes) -> bool:
        """Mark the snapshot under `key` most recently used; False when none is stored."""
        if key not in self._index:
            return False
        self._index.move_to_end(key)
        return True

    def save(self, key: bytes, slot: int, replaces: bytes | None = None) -> None:
        """Copy slot's states under `key` (evicting the least recently used when full); the
        row of `replaces` (an earlier snapshot of the same request), if still stored, is
        reused for it."""
        if key in self._index:
            self._index.move_to_end(key)
            return
        self.commit(key, self.stage(slot, replaces))

    def stage(self, slot: int, replaces: bytes | None = None) -> int:
        """Copy slot's states into a row now, keyed later by commit() (or given back by
        discard()): with overlap scheduling the copy must be queued before the next step
        changes the states, while the tokens it covers, which its key hashes, are still on the
        device. Row choice as save()."""
        if replaces is not None and replaces in self._index:
            row = self._index.pop(replaces)
        else:
            row = self._free.pop() if self._free else self._index.popitem(last=False)[1]
        for n, layer in enumerate(self.layers):
            self._conv[n][row] = self.kv.k[layer][slot]
            self._ssm[n][row] = self.kv.v[layer][slot]
        return row

    def commit(self, key: bytes, row: int) -> None:
        """Key a staged row; a key already stored keeps its row and the staged one is freed."""
        if key in self._index:
            self._index.move_to_end(key)
            self._free.append(row)
            return
        self._index[key] = row
        self.num_saved += 1

    def discard(self, row: int) -> None:
        """Give back a staged row that will not be committed (its request ended)."""
        self._free.append(row)

    def restore(self, key: bytes, slot: int) -> None:
        """Copy the snapshot under `key` into slot's states."""
        row = self._index[key]
        self._index.move_to_end(key)
        for n, layer in enumerate(self.layers):
            self.kv.k[layer][slot] = self._conv[n][row]
            self.kv.v[layer][slot] = self._ssm[n][row]
        self.num_restored += 1

    def stats(self) -> dict[str, int]:
        return {"state_snapshots": len(self._index), "state_snapshots_total": self.capacity,
                "state_snapshot_bytes": self.bytes_total,
                "state_snapshots_saved": self.num_saved,
                "state_snapshots_restored": self.num_restored}


def _dtype_name(array: Any) -> str:
    return str(array.dtype).replace("torch.", "")


def _nbytes(array: Any) -> int:
    return int(array.nbytes) if hasattr(array, "nbytes") else array.numel() * array.element_size()
