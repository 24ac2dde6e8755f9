"""Rolling a hybrid model's recurrent states back past rejected draft tokens.

A verify step (engine/speculative.py) runs each sequence's last token and its K drafts through
every layer, so a Gated DeltaNet layer's conv and delta-rule states move K+1 tokens on. When a
draft is rejected the states must stand after the accepted tokens only: the states of the
drafting sequences are copied before the step (`save`), and a rejected sequence gets its copy
back (`restore`) and runs its accepted tokens again in one small forward (the engine's replay),
which also rewrites their KV with the same values. The copies are transient (a sequence's
states are 2-60 MB), so the engine drafts only in steps of at most MAX_DRAFTING_HYBRID decoding
sequences.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# most decoding sequences of a hybrid model's step that drafts (each needs a transient copy)
MAX_DRAFTING_HYBRID = 8


class SavedStates:
    """Copies of some state slots' conv and delta-rule states, over every GDN layer."""

    def __init__(self, kv: Any, layers: list[int], slots: list[int], arrays: Any):
        self.kv, self.layers, self.arrays = kv, layers, arrays
        self.rows = {slot: row for row, slot in enumerate(slots)}
        index = arrays.index(np.asarray(slots, dtype=np.int64))
        # fancy indexing copies (numpy and torch alike)
        self.conv = [kv.k[i][index] for i in layers]
        self.ssm = [kv.v[i][index] for i in layers]

    def restore(self, slots: list[int]) -> None:
        """Put the saved states of `slots` back into the pool."""
        rows = self.arrays.index(np.asarray([self.rows[s] for s in slots], dtype=np.int64))
        where = self.arrays.index(np.asarray(slots, dtype=np.int64))
        for i, conv, ssm in zip(self.layers, self.conv, self.ssm):
            self.kv.k[i][where] = conv[rows]
            self.kv.v[i][where] = ssm[rows]
