"""Row parts of one projection (qkv, gate_up) joined at load: GGUF parts of one block type
become one matrix, and in a mix of types each run of adjacent parts of one type does."""

from __future__ import annotations

import numpy as np

from freetoken.models.checkpoint.weights import _fuse_rows
from freetoken.models.config import QuantWeight

Q5_0, Q8_0 = 6, 8


def _part(qtype: int, rows: int, row_bytes: int, fill: int) -> QuantWeight:
    cols = row_bytes // (22 if qtype == Q5_0 else 34) * 32
    return QuantWeight(qtype, np.full((rows, row_bytes), fill, np.uint8), (rows, cols))


def test_adjacent_parts_of_one_type_join_and_the_rest_stay():
    q, k, v = _part(Q5_0, 8, 44, 1), _part(Q5_0, 2, 44, 2), _part(Q8_0, 2, 68, 3)
    fused = _fuse_rows([q, k, v])
    assert len(fused) == 2 and fused[1] is v
    assert fused[0].qtype == Q5_0 and fused[0].shape == (10, 64)
    assert np.array_equal(fused[0].data, np.concatenate([q.data, k.data]))


def test_one_type_is_one_matrix_and_runs_split_at_each_change():
    gate, up = _part(Q8_0, 4, 68, 1), _part(Q8_0, 4, 68, 2)
    assert [w.shape for w in _fuse_rows([gate, up])] == [(8, 64)]
    a, b, c = _part(Q8_0, 2, 68, 1), _part(Q5_0, 2, 44, 2), _part(Q8_0, 2, 68, 3)
    assert _fuse_rows([a, b, c]) == [a, b, c]         # no two adjacent parts share a type
