"""Click types of the memory flags: `--num-tokens auto|N`, `--moe-cache-rate auto|R` and
`--gpu-memory-limit SIZE|FRACTION`."""

from __future__ import annotations

import click


class NumTokens(click.ParamType):
    """auto (or 0) -> 0, the engine's "size it for me"; else a whole number of tokens."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return 0
        try:
            tokens = int(text)
        except ValueError:
            self.fail(f"{value!r} is neither auto nor a whole number of tokens", param, ctx)
        if tokens < 0:
            self.fail(f"{tokens} is negative; pass auto or a number of tokens", param, ctx)
        return tokens


class CacheRate(click.ParamType):
    """auto -> None; else a float with 0 < R <= 1."""

    name = "auto|R"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, float):
            return value
        from freetoken.engine.config import EngineConfigError
        from freetoken.engine.offload_setup import parse_cache_rate

        try:
            return parse_cache_rate(value)
        except EngineConfigError as exc:
            self.fail(str(exc), param, ctx)


class GpuMemoryLimitParam(click.ParamType):
    """none -> None; SIZE (24GiB, 24GB, 24G, bytes) or FRACTION -> a GpuMemoryLimit."""

    name = "SIZE|FRACTION"

    def convert(self, value, param, ctx):
        from freetoken.engine.config import (EngineConfigError, GpuMemoryLimit,
                                             parse_gpu_memory_limit)

        if value is None or isinstance(value, GpuMemoryLimit):
            return value
        try:
            return parse_gpu_memory_limit(value)
        except EngineConfigError as exc:
            self.fail(str(exc), param, ctx)


NUM_TOKENS = NumTokens()
CACHE_RATE = CacheRate()
GPU_MEMORY_LIMIT = GpuMemoryLimitParam()
