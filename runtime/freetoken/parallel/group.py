"""The tensor-parallel process group and the three collectives the forward uses.

Collectives come only from torch.distributed: gloo on the CPU, NCCL on CUDA (RCCL on ROCm
builds of torch): nothing is compiled. Rank 0 hosts the rendezvous store; every collective
times out after `timeout` seconds, so a rank that stops answering fails the others' step
instead of hanging them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from freetoken.arrays import array_view, is_torch

# How long ranks wait for each other to join (spawned processes import torch first).
JOIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the ranks meet: rank 0's store address, the backend and the timeout."""

    host: str
    port: int
    size: int
    backend: str          # gloo | nccl
    timeout_s: float      # per collective


def backend_for(device: str) -> str:
    return "gloo" if device == "cpu" else "nccl"


def create_store(size: int):
    """Rank 0's rendezvous store on a free local port (its .port says which)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, size, is_master=True,
                         timeout=timedelta(seconds=JOIN_TIMEOUT_S), wait_for_workers=False)


def join(spec: GroupSpec, rank: int, store=None, device: Any = None) -> Comm:
    """Join the group as `rank` (rank 0 passes the store it created); returns its Comm."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(spec.host, spec.port, spec.size, is_master=False,
                              timeout=timedelta(seconds=JOIN_TIMEOUT_S))
    kwargs = {}
    if spec.backend == "nccl" and device is not None:
        kwargs["device_id"] = device      # binds the communicator to this rank's GPU
    # Joining waits as long as a spawned rank may take to import torch; the collectives run
    # in a second group created right after, when every rank is there, with the short timeout.
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.size,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S), **kwargs)
    steps = dist.new_group(list(range(spec.size)), timeout=timedelta(seconds=spec.timeout_s),
                           backend=spec.backend)
    return Comm(rank, spec.size, steps)


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Comm:
    """All-reduce (sum) in place and all-gather of rows, on numpy (CPU) or torch arrays."""

    def __init__(self, rank: int, size: int, process_group: Any = None):
        import torch
        import torch.distributed as dist

        self.rank, self.size, self.group = rank, size, process_group
        self._torch, self._dist = torch, dist

    def _tensor(self, array):
        """A torch tensor over the same memory (kernel arguments and numpy arrays alike)."""
        view = array_view(array)
        return view if is_torch(view) else self._torch.from_numpy(view)

    def all_reduce(self, array) -> None:
        """array = sum of every rank's array, in place."""
        self._dist.all_reduce(self._tensor(array), group=self.group)

    def all_gather_cols(self, array, width: int):
        """[B, size * cols] of every rank's [B, cols] side by side, cut to `width` columns;
        numpy in, numpy out."""
        local = self._tensor(array)
        parts = [self._torch.empty_like(local) for _ in range(self.size)]
        self._dist.all_gather(parts, local, group=self.group)
        joined = self._torch.cat(parts, dim=1)[:, :width]
        if is_torch(array):
            return joined.contiguous()
        return np.ascontiguousarray(joined.numpy())
