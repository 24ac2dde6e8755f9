"""Loading one rank: kernels, then the model read through a ShardedSource, so the forward is
built for the rank's shape from its weight slices; rank 0 and the workers share this."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from freetoken.parallel.group import Comm
from freetoken.parallel.rank import RankModel
from freetoken.parallel.shard import Shard, ShardedSource, check_shardable, local_config


def model_config(source: str | None):
    """The model's config from its header alone (no weight is read), to validate before any
    process starts or any weight loads."""
    from freetoken.models.checkpoint.default import default_model_path
    from freetoken.models.errors import ModelFormatError

    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        from freetoken.models.checkpoint.hf import read_hf_dir

        return read_hf_dir(path)[0]
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                from freetoken.models.checkpoint.gguf import read_gguf

                return read_gguf(path)[0]
    raise ModelFormatError(f"{path}: not a GGUF file or an HF model directory")


def set_cpu_threads(threads: int) -> None:
    """This rank's share of the cores for the CPU kernels and torch's own ops."""
    import torch

    from freetoken.kernel import ops

    ops.bind("set_num_threads", "cpu")(threads)
    torch.set_num_threads(threads)


def load_rank(source: str | None, device: str, dtype: str, comm: Comm, threads: int,
              plan: Callable | None = None, preload: bool = True) -> tuple[RankModel, dict[str, Any]]:
    """(the rank's model, what it reports: rank, device, weight bytes). The loaded model
    (tokenizer, defaults) is kept as ``model.loaded`` for rank 0. `preload` loads every
    kernel first (as ``ft serve`` does), else each loads on first use."""
    from freetoken.kernel.preload import load_kernels, plan_kernels
    from freetoken.models.loader import load_model, resolve_device

    where = resolve_device(device)
    if preload:
        load_kernels(where, plan_kernels(where), lambda message: None)
    sources: list[ShardedSource] = []

    def shard(config, tensors):
        check_shardable(config, comm.size, tensors.source)
        sources.append(ShardedSource(tensors, config, Shard(comm.rank, comm.size)))
        return local_config(config, comm.size), sources[-1]

    loaded = load_model(source, device=device, dtype=dtype, plan=plan, shard=shard)
    if where.is_cpu:
        set_cpu_threads(threads)
    model = RankModel(loaded.model, comm, loaded.config.vocab_size)
    model.loaded = loaded
    info = {"rank": comm.rank, "device": device,
            "weight_bytes": sources[0].placed_bytes(model.dtype)}
    return model, info
