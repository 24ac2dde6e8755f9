"""The expert cache's bookkeeping: one LRU over (layer, expert) keys shared by every MoE layer,
mapping each cached expert to a fixed slot of the GPU pool. Pure Python, no tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

Key = tuple[int, int]     # (MoE layer index, expert id)


class SlotLRU:
    """num_slots fixed slots; `lookup` touches, `place` assigns slots to new keys by evicting
    the least recently used keys that are not in `keep` (the experts the current layer's step
    is already reading)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._lru: OrderedDict[Key, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out the lowest slot

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: Key) -> bool:
        return key in self._lru

    def lookup(self, key: Key) -> int | None:
        slot = self._lru.get(key)
        if slot is not None:
            self._lru.move_to_end(key)
        return slot

    def lookup_layer(self, layer: int, experts: Iterable[int]) -> tuple[dict[int, int],
                                                                     list[int]]:
        """`lookup` of each (layer, expert), in order: ({expert: slot} of the hits, the
        misses). One call per MoE layer step keeps the per-expert cost to a dict probe."""
        get, touch, hits, misses = self._lru.get, self._lru.move_to_end, {}, []
        for e in experts:
            slot = get((layer, e))
            if slot is None:
                misses.append(e)
            else:
                touch((layer, e))
                hits[e] = slot
        return hits, misses

    def can_place(self, count: int, keep: Iterable[Key]) -> bool:
        if count <= len(self._free):
            return True
        keep = keep if isinstance(keep, (set, frozenset)) else set(keep)
        return count <= len(self._free) + len(self._lru) - len(keep & self._lru.keys())

    def place(self, keys: list[Key], keep: Iterable[Key]) -> list[tuple[Key, int, Key | None]]:
        """(key, slot, evicted key or None) for each new key, in order; raises ValueError when
        they do not fit (check can_place first)."""
        keep = keep if isinstance(keep, (set, frozenset)) else set(keep)
        if not self.can_place(len(keys), keep):
            raise ValueError(f"{len(keys)} experts do not fit in {self.num_slots} slots with "
                             f"{len(keep)} held")
        placed = []
        for key in keys:
            evicted = None
            if self._free:
                slot = self._free.pop()
            else:
                evicted = next(k for k in self._lru if k not in keep)
                slot = self._lru.pop(evicted)
            self._lru[key] = slot
            placed.append((key, slot, evicted))
        return placed

    def resize(self, num_slots: int) -> list[Key]:
        """Keep the entries whose slot is below the new size (their data is copied over by the
        caller); the rest are dropped and returned."""
        if num_slots < 1:
            raise ValueError(f"an expert cache needs at least one slot, got {num_slots}")
        dropped = [k for k, s in self._lru.items() if s >= num_slots]
        for key in dropped:
            del self._lru[key]
        used = set(self._lru.values())
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used]
        self.num_slots = num_slots
        return dropped

    def slots_of(self, layer: int) -> dict[int, int]:
        """expert id -> slot of every cached expert of `layer`."""
        return {e: s for (l, e), s in self._lru.items() if l == layer}

    def check_integrity(self) -> None:
        slots = list(self._lru.values())
        if len(set(slots)) != len(slots) or set(slots) & set(self._free) or \
                len(slots) + len(self._free) != self.num_slots or \
                any(not 0 <= s < self.num_slots for s in slots):
            raise RuntimeError(f"expert cache slots are inconsistent: {len(slots)} cached, "
                               f"{len(self._free)} free of {self.num_slots}")


class OffloadStats:
    """Running totals the cache reports in /v1/stats and /metrics."""

    def __init__(self) -> None:
        self.hits = self.misses = self.cpu_experts = self.bytes_h2d = 0
        self.tokens = self.streamed_layers = 0
        self.prefetched = self.prefetch_hits = 0    # copied ahead; of those, routed next

    def as_dict(self) -> dict[str, float]:
        looked = self.hits + self.misses
        return {"expert_hits": self.hits, "expert_misses": self.misses,
                "expert_hit_rate": self.hits / looked if looked else 0.0,
                "expert_cpu_executed": self.cpu_experts,
                "expert_bytes_h2d": self.bytes_h2d,
                "expert_bytes_per_token": self.bytes_h2d / self.tokens if self.tokens else 0.0,
                "expert_tokens": self.tokens,
                "expert_streamed_layers": self.streamed_layers,
                "expert_prefetched": self.prefetched,
                "expert_prefetch_hits": self.prefetch_hits}
