"""Engine configuration: a frozen dataclass plus one pure function that resolves "auto" values."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

SAMPLING_DEFAULT_MODES = ("model", "none")
DEVICES = ("auto", "cpu", "cuda")
KV_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8")
# speculative decoding (engine/speculative.py): off, prompt lookup, the model's MTP block, or
# auto (the MTP block where the model has one, else prompt lookup); drafts per step
SPECULATIVE_METHODS = ("off", "ngram", "mtp", "auto")
MAX_SPECULATIVE_TOKENS = 4
# max_queued_requests "auto": this many waiting requests per running slot. A request then
# waits behind at most eight turnovers of the batch, and a burst of a few batches is queued
# rather than refused.
QUEUED_PER_SEQ = 8


class EngineConfigError(ValueError):
    """An engine setting is out of range; the message names the setting and the fix."""


# --gpu-memory-limit units. GiB/MiB/KiB are binary and GB/MB/KB decimal, as written; a bare
# G/M/K is binary, as llama.cpp's and vLLM's users mean it (a "24G" card holds 24 GiB).
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
SIZE_UNITS = {"": 1, "b": 1, "k": KIB, "kib": KIB, "kb": 10**3, "m": MIB, "mib": MIB,
              "mb": 10**6, "g": GIB, "gib": GIB, "gb": 10**9, "t": TIB, "tib": TIB,
              "tb": 10**12}
_LIMIT_FORMS = ("a SIZE (24GiB, 24GB, 24G, 512MiB or a number of bytes) or a FRACTION in "
                "(0, 1] of the GPU's memory (0.5)")
_LIMIT_TEXT = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


@dataclass(frozen=True)
class GpuMemoryLimit:
    """--gpu-memory-limit: the most this process may hold on its GPU, as `size` bytes or as a
    `fraction` of the device's total memory (exactly one of the two is set). It caps every
    pool the memory plan sizes (weights, KV, experts or the expert cache, recurrent states,
    graphs, workspaces) and the margin, which becomes a share of the limit (engine/
    memory_plan.py); `text` is the flag's value as written, for messages."""

    size: int = 0
    fraction: float = 0.0
    text: str = ""

    def __post_init__(self) -> None:
        if (self.size > 0) == (self.fraction > 0) or self.size < 0 or \
                not 0.0 <= self.fraction <= 1.0:
            raise EngineConfigError(f"--gpu-memory-limit must be {_LIMIT_FORMS}, got "
                                    f"{self.text or (self.size or self.fraction)!r}")

    def bytes_on(self, total: int) -> int:
        """The limit in bytes on a device of `total` bytes; a size beyond the device is an
        error (the plan would promise memory the GPU does not have)."""
        if self.fraction:
            return int(self.fraction * total)
        if self.size > total:
            raise EngineConfigError(
                f"--gpu-memory-limit {self} is more than this GPU's {total / GIB:.2f} GiB; pass "
                f"a smaller SIZE, a FRACTION in (0, 1], or leave the flag out to use the whole "
                f"device")
        return self.size

    def __str__(self) -> str:
        return self.text or (f"{self.size}" if self.size else f"{self.fraction:g}")


def parse_gpu_memory_limit(text: str | None) -> GpuMemoryLimit | None:
    """'none' (or nothing) -> None; else a GpuMemoryLimit. A bare number is a FRACTION when it
    is at most 1 or has a decimal point, else bytes. Raises EngineConfigError naming the flag."""
    raw = "" if text is None else str(text).strip()
    if raw.lower() in ("", "none"):
        return None
    if raw.startswith("-"):
        raise EngineConfigError(f"--gpu-memory-limit must be positive: {_LIMIT_FORMS}, got "
                                f"{raw!r}")
    match = _LIMIT_TEXT.fullmatch(raw.lower())
    if match is None or match.group(2) not in SIZE_UNITS:
        raise EngineConfigError(f"--gpu-memory-limit must be {_LIMIT_FORMS}, got {raw!r}")
    number, unit = match.groups()
    value = float(number)
    if not unit and ("." in number or value <= 1):
        if not 0.0 < value <= 1.0:
            raise EngineConfigError(f"--gpu-memory-limit: a FRACTION must be in (0, 1], got "
                                    f"{raw!r}; a SIZE needs a unit (24GiB) or whole bytes")
        return GpuMemoryLimit(fraction=value, text=raw)
    size = int(value * SIZE_UNITS[unit])
    if not unit and size < MIB:    # "24" is surely 24 GiB, not 24 bytes
        raise EngineConfigError(f"--gpu-memory-limit {raw} is {size} bytes; write the unit "
                                f"({raw}GiB) or a FRACTION in (0, 1]")
    if size <= 0:
        raise EngineConfigError(f"--gpu-memory-limit must be more than 0 bytes, got {raw!r}")
    return GpuMemoryLimit(size=size, text=raw)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes its KV pool and batches work.

    num_tokens: KV pool size in tokens (0 = auto: a few full contexts, see resolve_engine_config).
    block_size: tokens per KV page.
    max_num_seqs: most sequences in one step (running decodes plus prefills).
    max_queued_requests: most requests waiting beyond the max_num_seqs that run; more are
        refused at once (HTTP 503/529 with Retry-After) rather than queued without bound.
        None = auto: QUEUED_PER_SEQ * max_num_seqs.
    max_prefill_tokens: prefill tokens per step; longer prompts are prefilled in chunks.
    sampling_defaults: "model" applies the model's generation_config to unset request fields;
        "none" ignores it (neutral defaults: temperature 1, top_k off, top_p 1).
    device: "auto" (cuda when available), "cpu" or "cuda[:N]".
    cuda_graphs: on CUDA, capture decode steps as CUDA graphs at start.
    kv_dtype: KV pool dtype; "auto" = float16 on the CPU (half the memory and bandwidth of
        its float32 activations), the activation dtype on a GPU; "fp8" = e4m3 with a float32
        scale per token and KV head (about half of bf16's bytes).
    prefix_cache: keep full KV pages after a request ends, keyed by a hash chain of their
        tokens, and start later requests with the same prefix from them.
    overlap: on a GPU, schedule and prepare the next decode step while the current one runs
        (see engine/overlap.py); the CPU computes on the engine thread, so it never overlaps.
    gpu_memory_limit: the most the engine plans to hold on its GPU (None: the whole device);
        see GpuMemoryLimit. Ignored on the CPU.
    speculative: "off", "ngram" (prompt lookup drafts, verified several tokens per forward;
        see engine/speculative.py), "mtp" (drafts from the checkpoint's multi-token-prediction
        block, engine/mtp_drafts.py) or "auto" (mtp where the model has the block, else ngram).
    num_speculative_tokens: most draft tokens per sequence and step (1..4).
    """

    num_tokens: int = 0
    block_size: int = 16
    max_num_seqs: int = 32
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 1024
    sampling_defaults: str = "model"
    device: str = "auto"
    cuda_graphs: bool = True
    kv_dtype: str = "auto"
    prefix_cache: bool = True
    overlap: bool = True
    gpu_memory_limit: GpuMemoryLimit | None = None
    speculative: str = "off"
    num_speculative_tokens: int = 2

    def __post_init__(self) -> None:
        checks = (
            (self.num_tokens >= 0, "num_tokens must be >= 0 (0 = auto)"),
            (self.block_size >= 1, "block_size must be >= 1"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_queued_requests is None or self.max_queued_requests >= 0,
             "max_queued_requests must be >= 0 (None = auto)"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
            (self.sampling_defaults in SAMPLING_DEFAULT_MODES,
             f"sampling_defaults must be one of {SAMPLING_DEFAULT_MODES}"),
            (self.device.split(":")[0] in DEVICES, f"device must be one of {DEVICES} (or cuda:N)"),
            (self.kv_dtype in KV_DTYPES, f"kv_dtype must be one of {KV_DTYPES}"),
            (self.gpu_memory_limit is None or isinstance(self.gpu_memory_limit, GpuMemoryLimit),
             "gpu_memory_limit must be None or a GpuMemoryLimit (see parse_gpu_memory_limit)"),
            (self.speculative in SPECULATIVE_METHODS,
             f"speculative must be one of {SPECULATIVE_METHODS}"),
            (1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}"),
        )
        for ok, message in checks:
            if not ok:
                raise EngineConfigError(f"{message}; got {self!r}")
        if 0 < self.num_tokens < self.block_size:
            raise EngineConfigError(
                f"num_tokens={self.num_tokens} is smaller than one page ({self.block_size} tokens)")

    @property
    def num_blocks(self) -> int:
        """Pages in the pool (num_tokens rounded down to whole pages)."""
        return self.num_tokens // self.block_size


def default_num_tokens(context_len: int) -> int:
    """Room for four requests of up to 4096 tokens each (or four full shorter contexts)."""
    return 4 * min(context_len, 4096)


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is usable, else 'cpu' (without importing torch when the
    machine has no GPU device files)."""
    if device != "auto":
        return device
    from freetoken.arrays import gpu_available

    return "cuda" if gpu_available() else "cpu"


def resolve_kv_dtype(kv_dtype: str, on_cpu: bool, activation_dtype: str) -> str:
    """The KV pool dtype: auto -> float16 on the CPU, the activation dtype on a GPU (where the
    attention kernels read the pool in the activation dtype); fp8 (e4m3 with a scale per
    token and KV head, models/batch.py Fp8Pool) on either."""
    if kv_dtype == "auto":
        return "float16" if on_cpu else activation_dtype
    if kv_dtype == "fp8":
        if not on_cpu and activation_dtype == "float32":
            raise EngineConfigError("--kv-dtype fp8 on a GPU reads the pool into bfloat16 or "
                                    "float16 attention; pass --dtype bfloat16 or --kv-dtype auto")
        return kv_dtype
    if on_cpu and kv_dtype == "bfloat16":
        raise EngineConfigError("kv_dtype bfloat16 is not available on the CPU; use float16 "
                                "or float32")
    if not on_cpu and kv_dtype != activation_dtype:
        raise EngineConfigError(f"on a GPU the KV pool uses the activation dtype "
                                f"({activation_dtype}); got kv_dtype {kv_dtype}: pass --kv-dtype "
                                f"auto or --dtype {kv_dtype}")
    return kv_dtype


def resolve_engine_config(config: EngineConfig, context_len: int) -> EngineConfig:
    """A copy with every auto value filled in for a model of `context_len` tokens."""
    num_tokens = config.num_tokens or default_num_tokens(context_len)
    num_tokens = max(config.block_size, num_tokens - num_tokens % config.block_size)
    queued = config.max_queued_requests
    return replace(config, num_tokens=num_tokens, device=resolve_device(config.device),
                   max_queued_requests=QUEUED_PER_SEQ * config.max_num_seqs if queued is None
                   else queued)
