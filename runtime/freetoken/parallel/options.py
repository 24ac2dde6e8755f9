"""`--tensor-parallel-size` and `--gpus`, checked before anything loads: each refusal is one
line naming the option and the reason."""

from __future__ import annotations

from dataclasses import dataclass


class ParallelOptionError(ValueError):
    """A tensor-parallel option a user can fix."""


@dataclass(frozen=True)
class ParallelConfig:
    """N ranks and each rank's device (rank r runs on devices[r])."""

    size: int = 1
    devices: tuple[str, ...] = ("cpu",)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1


def parse_size(text: str | int) -> int:
    try:
        size = int(str(text).strip())
    except ValueError:
        raise ParallelOptionError(f"--tensor-parallel-size {text!r} is not an integer") from None
    if size < 1:
        raise ParallelOptionError(f"--tensor-parallel-size {size} must be at least 1")
    return size


def parse_gpus(text: str) -> tuple[int, ...]:
    """'0,1,...' as distinct non-negative ids."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ParallelOptionError(f"--gpus {text!r}: {part!r} is not a GPU id (use "
                                      f"non-negative integers separated by commas, e.g. 0,1)")
        ids.append(int(part))
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ParallelOptionError(f"--gpus {text!r} names GPU {duplicates[0]} more than once")
    return tuple(ids)


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_parallel(size_text: str | int, gpus_text: str | None, device: str,
                     count=gpu_count) -> ParallelConfig:
    """The ranks' devices for `device` (cpu, cuda, cuda:N, auto); raises ParallelOptionError.
    On the CPU every rank is a process of this machine; on GPUs one GPU per rank, --gpus or
    the first N."""
    size = parse_size(size_text)
    gpus = parse_gpus(gpus_text) if gpus_text is not None else None
    if size == 1 and gpus is None:      # not split: the device options work as before
        return ParallelConfig(1, (device,))
    on_cpu = device == "cpu" or (device == "auto" and gpus is None and count() == 0)
    if on_cpu:
        if gpus is not None:
            raise ParallelOptionError("--gpus needs a GPU device; drop it, or pass "
                                      "--device cuda (or auto)")
        return ParallelConfig(size, ("cpu",) * size)
    present = count()
    if gpus is None:
        first = int(device.split(":")[1]) if ":" in device else 0
        gpus = tuple(range(first, first + size))
        if first + size > present:
            raise ParallelOptionError(f"--tensor-parallel-size {size} needs {size} GPUs from "
                                      f"{first} but {present} are present; pass --gpus")
    if len(gpus) != size:
        raise ParallelOptionError(f"--gpus lists {len(gpus)} GPU(s) but "
                                  f"--tensor-parallel-size is {size}; give one GPU per rank")
    missing = [g for g in gpus if g >= present]
    if missing:
        seen = f"ids 0..{present - 1}" if present else "torch sees no GPU"
        raise ParallelOptionError(f"--gpus: GPU {missing[0]} is not present ({seen})")
    return ParallelConfig(size, tuple(f"cuda:{g}" for g in gpus))


def check_engine_options(config: ParallelConfig, explicit: dict[str, object]) -> None:
    """Refuse, by name, options tensor parallelism does not support yet; `explicit` holds the
    options the user passed (not defaults)."""
    if not config.is_parallel:
        return
    rate = explicit.get("moe_cache_rate")
    if rate is not None and float(rate) < 1.0:
        raise ParallelOptionError("--moe-cache-rate below 1 (expert offload) is not supported "
                                  "with --tensor-parallel-size > 1; drop it, or serve with -tp 1")
    if explicit.get("overlap"):
        raise ParallelOptionError("--overlap is not supported with --tensor-parallel-size > 1 "
                                  "(the other ranks never see rank 0's sampled tokens); drop it")


def parallel_engine_config(ctx, engine_config, size_text: str, gpus_text: str | None):
    """(engine config for rank 0, ParallelConfig) from `ft serve`'s options; a refusal is a
    one-line ClickException."""
    import dataclasses

    import click
    from click.core import ParameterSource

    explicit = {name: ctx.params.get(name) for name in ("moe_cache_rate", "overlap")
                if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    try:
        parallel = resolve_parallel(size_text, gpus_text, engine_config.device)
        check_engine_options(parallel, explicit)
    except ParallelOptionError as exc:
        raise click.ClickException(str(exc)) from None
    if not parallel.is_parallel and gpus_text is None:
        return engine_config, parallel
    # NOTE: overlap scheduling fills a step's ids on rank 0's GPU, which the others never see
    return dataclasses.replace(engine_config, device=parallel.devices[0],
                               overlap=engine_config.overlap and not parallel.is_parallel), \
        parallel
