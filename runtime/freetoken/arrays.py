"""Arrays on the serving device: numpy on the CPU, torch tensors on a GPU.

The CPU path never imports torch (the import alone costs seconds of start-up and ~200 MB of
memory); the kernels take numpy arrays and torch tensors alike through DLPack. Code shared by
both paths uses this small surface plus what numpy and torch have in common: slicing views,
``reshape``, row gathers ``a[index]``, ``a[...] = b`` and ``+=``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
INDEX_DTYPES = ("int32", "int64", "uint8")     # kernel bookkeeping and scratch buffers
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16"}


class DeviceError(ValueError):
    """A device or dtype name that this runtime cannot serve on."""


@dataclass(frozen=True)
class Device:
    """cpu, or cuda with an optional index."""

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def is_cpu(self) -> bool:
        return self.type == "cpu"


def parse_device(name: str) -> Device:
    """cpu, cuda, cuda:N, or auto (cuda when a GPU is usable, else cpu)."""
    name = str(name).strip().lower()
    if name == "auto":
        return Device("cuda") if gpu_available() else Device("cpu")
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (colon and not index.isdigit()) or (kind == "cpu" and colon):
        raise DeviceError(f"device {name!r} is not supported; use cpu, cuda, cuda:N or auto")
    return Device(kind, int(index) if index else None)


# What fixes a GPU request on a machine without torch (the CPU path never needs it).
CUDA_INSTALL_HINT = ("pip install 'freetoken[cuda]' --extra-index-url "
                     "https://download.pytorch.org/whl/cu130")


def torch_installed() -> bool:
    """Whether `import torch` can work, found without importing it (seconds, ~200 MB)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def gpu_device_files() -> bool:
    """NVIDIA, WSL2's GPU bridge or AMD ROCm device files: a GPU may be here."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg",
                                           "/dev/kfd"))


def gpu_available() -> bool:
    """True when torch sees a GPU. Machines without GPU device files, or without torch, answer
    without importing torch, so CPU-only serving starts fast."""
    if not gpu_device_files():
        return False
    if not torch_installed():
        logging.getLogger("freetoken").warning(
            "a GPU is present but torch is not installed, so FreeToken serves on the CPU; "
            "for GPU serving: %s", CUDA_INSTALL_HINT)
        return False
    import torch

    return torch.cuda.is_available()


def canonical_dtype(name: str) -> str:
    name = _ALIASES.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise DeviceError(f"dtype {name!r} is not supported; use auto, float32, bfloat16 "
                          f"or float16")
    return name


def is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


class HostArrays:
    """numpy arrays in host memory (float32 and float16; numpy has no bfloat16)."""

    device = Device("cpu")
    no_grad = staticmethod(contextlib.nullcontext)
    _DTYPES = {"float32": np.float32, "float16": np.float16}

    @staticmethod
    def dtype(name: str):
        if name in INDEX_DTYPES:
            return np.dtype(name).type
        name = canonical_dtype(name)
        if name not in HostArrays._DTYPES:
            raise DeviceError(f"{name} arrays are not available on the CPU; use float32 or "
                              f"float16")
        return HostArrays._DTYPES[name]

    def empty(self, shape, dtype: str = "float32") -> np.ndarray:
        return np.empty(shape, dtype=self.dtype(dtype))

    @staticmethod
    def index(values: np.ndarray) -> np.ndarray:
        """Host integers (int32 or int64) as arrays on this device."""
        return values

    @staticmethod
    def kernel_arg(array):
        """A tvm_ffi.Tensor over the same memory: a kernel call takes it as is, while a numpy
        array is converted on every call (~0.5 us each, ~40 per layer of a decode step)."""
        return import_tvm_ffi().from_dlpack(array)

    def place(self, weight, dtype: str) -> np.ndarray:
        """A weight from a checkpoint (numpy or torch) as a contiguous array of `dtype`."""
        if is_torch(weight):
            import torch

            weight = weight.to(torch.float32).numpy()
        return np.ascontiguousarray(weight, dtype=self.dtype(dtype))


class TorchArrays:
    """torch tensors on one GPU."""

    def __init__(self, device: Device):
        import torch

        self.torch = torch
        self.device = device
        self.torch_device = torch.device(str(device))
        self.no_grad = torch.inference_mode

    def dtype(self, name: str):
        return getattr(self.torch, name if name in INDEX_DTYPES else canonical_dtype(name))

    def empty(self, shape, dtype: str = "float32"):
        return self.torch.empty(shape, dtype=self.dtype(dtype), device=self.torch_device)

    def index(self, values: np.ndarray):
        return self.torch.from_numpy(values).to(self.torch_device, non_blocking=True)

    @staticmethod
    def kernel_arg(array):
        return array     # torch tensors reach the kernels without a per-call conversion cost

    def place(self, weight, dtype: str):
        data = weight if is_torch(weight) else self.torch.from_numpy(np.ascontiguousarray(weight))
        return data.to(device=self.torch_device, dtype=self.dtype(dtype)).contiguous()


def array_view(arg):
    """Where array ops must run on a kernel argument: torch tensors as they are, anything else
    (a tvm_ffi.Tensor made by ``kernel_arg``, a numpy array) as a numpy view of its memory."""
    return arg if is_torch(arg) else np.from_dlpack(arg)


def arrays_for(device: Device | str) -> HostArrays | TorchArrays:
    device = device if isinstance(device, Device) else parse_device(device)
    return HostArrays() if device.is_cpu else TorchArrays(device)


def import_tvm_ffi():
    """tvm_ffi, imported without pulling torch in when nothing has imported torch yet.

    tvm_ffi imports torch eagerly when it is installed; torch tensors passed later still work
    (they carry their own DLPack exchange table), so the CPU path can leave torch unloaded.
    """
    import sys

    if "tvm_ffi" in sys.modules or "torch" in sys.modules:
        import tvm_ffi

        return tvm_ffi
    sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail fast
    try:
        import tvm_ffi
    finally:
        del sys.modules["torch"]
    return tvm_ffi
