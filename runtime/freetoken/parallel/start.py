"""Rank 0's start-up under tensor parallelism: check the model splits, spawn ranks 1..N-1
(they load their shards while rank 0 loads its own), join the group, wait for every rank."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from freetoken.parallel import group
from freetoken.parallel.front import ShardedModel
from freetoken.parallel.launch import Ranks
from freetoken.parallel.load import load_rank, model_config
from freetoken.parallel.options import ParallelConfig
from freetoken.parallel.shard import check_shardable
from freetoken.parallel.worker import WorkerSpec


def threads_per_rank(size: int) -> int:
    """FREETOKEN_NUM_THREADS (0 = every core) shared out over the ranks of this machine."""
    from freetoken import env

    total = env.read().num_threads or os.cpu_count() or 1
    return max(1, total // size)


def start_sharded(source: str | None, dtype: str, parallel: ParallelConfig,
                  plan: Callable | None = None, say: Callable[[str], None] = lambda m: None,
                  preload: bool = True) -> Any:
    """A LoadedModel whose model is a ShardedModel over `parallel.size` ranks.

    Raises ShardError (the model does not split: before any process starts), RankFailed
    (a rank died or failed while loading), and the loader's errors for rank 0."""
    from freetoken import env

    size = parallel.size
    check_shardable(model_config(source), size, source or "the default model")
    store = group.create_store(size)
    spec = group.GroupSpec("127.0.0.1", store.port, size,
                           group.backend_for(parallel.devices[0].split(":")[0]),
                           float(env.read().tp_timeout_s))
    threads = threads_per_rank(size)
    ranks = Ranks(spec, store, [WorkerSpec(r, spec, source, parallel.devices[r], dtype, threads,
                                           preload) for r in range(1, size)])
    for rank, pid in enumerate(ranks.pids(), 1):
        say(f"tensor-parallel rank {rank} started (pid {pid}, {parallel.devices[rank]})")
    try:
        device = parallel.devices[0]
        if device != "cpu":
            import torch

            torch.cuda.set_device(torch.device(device))
        comm = ranks.while_alive(lambda: group.join(
            spec, 0, store=store, device=None if device == "cpu" else _torch_device(device)))
        model, info = load_rank(source, device, dtype, comm, threads, plan, preload)
        infos = [info] + ranks.wait_ready()
    except BaseException:
        ranks.close()
        group.leave()
        raise
    ranks.watch()
    loaded = model.loaded
    return dataclasses.replace(loaded, model=ShardedModel(model, ranks, infos))


def _torch_device(name: str):
    import torch

    return torch.device(name)


def no_offload(planner: Callable | None) -> Callable | None:
    """The memory plan per rank (it sees the rank's shape), refusing expert offload."""
    if planner is None:
        return None

    def plan(cfg, dtype: str, weights=None) -> bool:
        if planner(cfg, dtype, weights):
            from freetoken.models.errors import ModelOptionError

            raise ModelOptionError("this rank's experts do not fit on its GPU and expert "
                                   "offload is not supported with --tensor-parallel-size > 1; "
                                   "use more GPUs (-tp) or serve with -tp 1")
        return False

    return plan
