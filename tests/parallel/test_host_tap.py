"""Rank 0 on a GPU sends each step's batch from the host arrays it copied to the device (no
copy back): views of the device tensors map to the same host values."""

from __future__ import annotations

import numpy as np
import torch

from freetoken.arrays import TorchArrays, parse_device
from freetoken.parallel.front import HostTap


def test_views_of_tapped_tensors_read_their_host_values():
    tap = HostTap(TorchArrays(parse_device("cpu")))
    wide = np.arange(12, dtype=np.int64) * 3
    narrow = np.arange(20, dtype=np.int32) + 100
    a, b = tap.index(wide), tap.index(narrow)
    fields = [a[:4], a[4:8], b[:12].reshape(3, 4), b[12:15]]
    for field in fields:
        host = tap.host(field)
        assert isinstance(host, np.ndarray)
        np.testing.assert_array_equal(host, field.numpy())
    # a tensor the tap never saw is copied back instead
    other = torch.arange(5)
    np.testing.assert_array_equal(tap.host(other), other.numpy())
