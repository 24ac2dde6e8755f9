"""Recurrent-state slots of a hybrid model's Gated DeltaNet layers: one slot per running
sequence, beside the paged KV pool. The states themselves live in the KVCache (the GDN layers'
k/v entries); this allocator only hands out their indices. Not thread-safe: the engine calls it
under its lock, through the scheduler (allocated at admission, freed at finish or preemption).
The pool can be resized live (`ft ctl cache --states`): a sequence is admitted only while a slot
is free, so fewer slots than --max-num-seqs cap the sequences run at once.
"""

from __future__ import annotations


class StateSlots:
    """Slot ids 0..num_slots-1; at start as many as the engine runs sequences at once
    (max_num_seqs), so an admitted sequence always finds one."""

    def __init__(self, num_slots: int, bytes_per_slot: int):
        if num_slots < 1:
            raise ValueError(f"a state pool needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def held_from(self, first: int) -> int:
        """Slots with ids >= first that are in use (what a shrink to `first` slots would drop)."""
        free = set(self._free)
        return sum(1 for s in range(first, self.num_slots) if s not in free)

    def resize(self, num_slots: int) -> None:
        """num_slots slots; the ones in use keep their ids (the caller checked held_from)."""
        if num_slots < 1 or self.held_from(num_slots):
            raise RuntimeError(f"cannot resize the state pool to {num_slots} slots")
        used = set(range(self.num_slots)) - set(self._free)
        self.num_slots = num_slots
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in used]

    def allocate(self) -> int:
        if not self._free:   # the scheduler admits only while a slot is free
            raise RuntimeError(f"all {self.num_slots} recurrent-state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"state slot {slot} freed twice or out of range")
        self._free.append(slot)

    def stats(self) -> dict[str, int]:
        return {"state_slots_used": self.num_used, "state_slots_total": self.num_slots,
                "state_bytes_per_slot": self.bytes_per_slot,
                "state_bytes_total": self.bytes_per_slot * self.num_slots}
