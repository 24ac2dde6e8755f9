"""Rank 0's model as the engine sees it: every call the engine makes (reserve, forward, graph
capture and replay, a new KV pool) is first sent to the other ranks, then run on rank 0's
shard; the logits come back whole (all-gathered) and rank 0 samples.

``config`` is the rank's shape (its KV heads size the per-rank pool and its fit check) with
the full vocabulary (requests are checked against it)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from freetoken.arrays import is_torch
from freetoken.parallel.launch import RankFailed, Ranks
from freetoken.parallel.rank import RankModel
from freetoken.parallel.worker import describe_batch

_TAPPED = 8   # host copies kept for recent device batches (one step needs two)


class HostTap:
    """The GPU arrays of rank 0, remembering the host arrays it copied to the device lately,
    so a step's batch reaches the other ranks without a copy back from the GPU."""

    def __init__(self, arrays: Any):
        self._arrays = arrays
        self._hosts: OrderedDict[int, np.ndarray] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._arrays, name)

    def index(self, values: np.ndarray):
        tensor = self._arrays.index(values)
        self._hosts[tensor.untyped_storage().data_ptr()] = values
        while len(self._hosts) > _TAPPED:
            self._hosts.popitem(last=False)
        return tensor

    def host(self, field) -> np.ndarray:
        if not is_torch(field):
            return np.asarray(field)
        values = self._hosts.get(field.untyped_storage().data_ptr())
        if values is None or not field.is_contiguous():
            return field.cpu().numpy()
        start = field.storage_offset()
        return values.reshape(-1)[start:start + field.numel()].reshape(tuple(field.shape))


class ShardedModel:
    """The engine's model under tensor parallelism (rank 0 of `ranks.size`)."""

    def __init__(self, rank_model: RankModel, ranks: Ranks, rank_infos: list[dict]):
        self.rank, self.ranks = rank_model, ranks
        self.config, self.dtype, self.device = rank_model.config, rank_model.dtype, \
            rank_model.device
        self.arrays = rank_model.arrays if self.device.is_cpu else HostTap(rank_model.arrays)
        self.tensor_parallel_size = ranks.size
        self.rank_infos = rank_infos
        self._kv = None

    def _host(self, field):
        return field if isinstance(field, np.ndarray) else self.arrays.host(field)

    def _call(self, run, *args):
        try:
            return run(*args)
        except RankFailed as exc:
            self.ranks.report(0, f"lost a peer: {exc}")
            raise
        except RuntimeError as exc:     # torch.distributed: a peer died or timed out
            self.ranks.collective_failed(exc)
            raise

    def sync_kv(self, kv) -> None:
        """Other ranks allocate a pool like `kv` when the engine starts using a new one."""
        if kv is not self._kv:
            dtype = str(kv.k[0].dtype).replace("torch.", "")
            self._call(self.ranks.send, ("kv", kv.num_blocks, kv.block_size, dtype))
            self._kv = kv

    def reserve(self, max_tokens: int) -> None:
        self._call(self.ranks.send, ("reserve", max_tokens))
        self.rank.reserve(max_tokens)

    def forward(self, batch, kv):
        self.sync_kv(kv)
        self._call(self.ranks.send, ("forward", describe_batch(batch, self._host)))
        logits = self._call(self.rank.forward, batch, kv)
        self.ranks.steps[0] += 1
        return logits

    def decode_graphs(self, kv, max_batch: int, max_blocks: int):
        """Decode CUDA graphs captured on every rank at once (the collectives inside them
        line up: each rank captures the same sizes in the same order)."""
        from freetoken.parallel.graphs import ShardedGraphs

        self.sync_kv(kv)
        self._call(self.ranks.send, ("graphs", max_batch, max_blocks))
        return self._call(ShardedGraphs(self, kv, max_batch, max_blocks).capture)

    def parallel_stats(self) -> dict[str, Any]:
        """tensor_parallel_size and each rank's memory: weights and KV pool bytes (every
        rank's pool has rank 0's shape)."""
        kv = self._kv
        kv_bytes = 0 if kv is None else sum(int(getattr(t, "nbytes", 0) or
                                                t.numel() * t.element_size())
                                            for t in kv.k + kv.v)
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "ranks": [{"rank": info["rank"], "device": info["device"],
                           "weight_bytes": info["weight_bytes"], "kv_pool_bytes": kv_bytes}
                          for info in self.rank_infos]}

    @property
    def fault(self) -> str | None:
        return self.ranks.fault

    def close(self) -> None:
        """Stop the other ranks and leave the group (idempotent)."""
        from freetoken.parallel import group

        self.ranks.close()
        group.leave()
