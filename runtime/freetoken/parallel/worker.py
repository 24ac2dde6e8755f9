"""A tensor-parallel rank other than 0: a spawned process that loads its shard and runs the
same forward as rank 0 for every step rank 0 sends it (over a pipe: small, host-side, outside
any CUDA graph); its collectives meet rank 0's.

Messages from rank 0: ("kv", num_blocks, block_size, dtype) a new KV pool (what fits of the
old one is copied over: a live resize); ("reserve", tokens); ("forward", batch); ("graphs",
max_batch, max_blocks) capture decode graphs; ("replay", batch); ("stop",). To rank 0:
("ready", info) once loaded, ("error", line) before exiting on an exception.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from freetoken.parallel.group import GroupSpec

HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    group: GroupSpec
    source: str | None
    device: str            # cpu, or cuda:N (this rank's GPU)
    dtype: str
    threads: int           # CPU kernel threads of this rank
    preload: bool = True   # load every kernel before the model (ft serve), else on first use


def describe_batch(batch: Any, host_of) -> dict[str, Any]:
    """A ForwardBatch as host arrays (what crosses the pipe); host_of(field) -> numpy."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        out[field.name] = value if value is None or isinstance(value, int) else host_of(value)
    return out


def rebuild_batch(fields: dict[str, Any], arrays: Any):
    from freetoken.models.batch import ForwardBatch

    return ForwardBatch(**{k: arrays.index(v) if isinstance(v, np.ndarray) else v
                           for k, v in fields.items()})


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the server process dies, even by SIGKILL."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _beat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_S)


def run_worker(spec: WorkerSpec, conn, beats, steps) -> None:
    """The process's target: load, report ready, serve steps until told to stop."""
    _die_with_parent()
    beats[spec.rank] = time.monotonic()
    threading.Thread(target=_beat, args=(beats, spec.rank), daemon=True).start()
    from freetoken.parallel import group

    try:
        from freetoken.parallel.load import load_rank

        device = None if spec.device == "cpu" else spec.device
        if device is not None:
            import torch

            torch.cuda.set_device(torch.device(device))
            device = torch.device(device)
        comm = group.join(spec.group, spec.rank, device=device)
        model, info = load_rank(spec.source, spec.device, spec.dtype, comm, spec.threads,
                                preload=spec.preload)
        conn.send(("ready", info))
        _serve(conn, model, steps, spec.rank)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass     # rank 0 went away: it reports why
    except BaseException as exc:   # noqa: BLE001 - reported to rank 0, which names it
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}".splitlines()[0]))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)
    finally:
        group.leave()


def _serve(conn, model, steps, rank: int) -> None:
    kv, graphs = None, None
    while True:
        op, *args = conn.recv()
        if op == "stop":
            return
        if op == "kv":
            kv = new_kv(model, kv, *args)
        elif op == "reserve":
            model.reserve(args[0])
        elif op == "graphs":
            from freetoken.engine.cuda_graph import DecodeGraphs

            graphs = DecodeGraphs(model, kv, *args).capture()
        elif op in ("forward", "replay"):
            batch = rebuild_batch(args[0], model.arrays)
            with model.arrays.no_grad():
                if op == "replay":
                    graphs.run(batch)
                else:
                    model.forward(batch, kv)
            steps[rank] += 1
        else:
            raise RuntimeError(f"unknown message {op!r} from rank 0")


def new_kv(model, old, num_blocks: int, block_size: int, dtype: str):
    """This rank's KV pool (its KV heads) of `num_blocks` pages; the slots both pools have
    keep their contents (rank 0's live resize does the same with its own pool)."""
    from freetoken.models.batch import KVCache

    new = KVCache(model.config, num_blocks, block_size, dtype, model.arrays)
    if old is not None:
        keep = min(old.num_slots, new.num_slots)
        for pools_new, pools_old in ((new.k, old.k), (new.v, old.v)):
            for dst, src in zip(pools_new, pools_old):
                dst[:keep] = src[:keep]
    return new
