"""Which cache target can run on a device, by CUDA's compatibility rules (never by trying).

SASS sm_XY runs on the same major with minor >= Y; `a` targets on that exact arch only; `f`
targets on the family (same major, minor >= Y); PTX compute_XY on any arch >= XY (the driver
compiles it). A `.so` loads even without an image for the GPU, so the choice must be made here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """What a kernel must run on: cpu, a CUDA capability, or a ROCm gfx arch."""

    backend: str                       # cpu | cuda | rocm
    capability: tuple[int, int] | None = None
    gfx: str | None = None

    def __str__(self) -> str:
        if self.backend == "cuda":
            return f"CUDA sm_{self.capability[0]}{self.capability[1]}"
        if self.backend == "rocm":
            return f"ROCm {self.gfx}"
        return "cpu-x86_64"


def device_parts(device: Any) -> tuple[str, int | None]:
    """(type, index) of a device name, a freetoken Device or a torch.device."""
    if isinstance(device, str):
        from freetoken.arrays import parse_device

        device = parse_device(device)
    return device.type, device.index


def device_spec(device: Any) -> DeviceSpec:
    """What runs on `device` ("cpu", "cuda:0", a freetoken Device or a torch.device); only a GPU
    device imports torch."""
    kind, index = device_parts(device)
    if kind == "cpu":
        return DeviceSpec("cpu")
    if kind == "cuda":
        import torch

        index = index if index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if getattr(torch.version, "hip", None):
            return DeviceSpec("rocm", gfx=props.gcnArchName.split(":")[0])
        return DeviceSpec("cuda", capability=(props.major, props.minor))
    raise ValueError(f"no kernels for device type {kind!r}")


def _parse_cuda(target: str) -> tuple[str, int, int, str] | None:
    m = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", target)
    if not m:
        return None
    kind, major, minor, suffix = m.groups()
    return kind, int(major), int(minor), suffix


def cuda_target_runs_on(target: str, capability: tuple[int, int]) -> bool:
    parsed = _parse_cuda(target)
    if parsed is None:
        return False
    kind, major, minor, suffix = parsed
    if kind == "compute":
        return capability >= (major, minor)
    if suffix == "a":
        return capability == (major, minor)
    return capability[0] == major and capability[1] >= minor


def rank_targets(available: list[str] | tuple[str, ...], spec: DeviceSpec) -> list[str]:
    """Targets from `available` that run on `spec`, best first (closest SASS, then PTX)."""
    if spec.backend == "cpu":
        return [t for t in available if t == "cpu-x86_64"]
    if spec.backend == "rocm":
        return [t for t in available if t == spec.gfx]
    usable = [t for t in available if cuda_target_runs_on(t, spec.capability)]

    def score(target: str) -> tuple[int, int, int]:
        kind, major, minor, suffix = _parse_cuda(target)
        native = 1 if kind == "sm" else 0
        specific = {"a": 2, "f": 1, "": 0}[suffix]
        return native, major * 10 + minor, specific

    return sorted(usable, key=score, reverse=True)


def jit_target(spec: DeviceSpec) -> str:
    """The target a JIT build compiles for this exact device."""
    if spec.backend == "cpu":
        return "cpu-x86_64"
    if spec.backend == "rocm":
        return spec.gfx
    major, minor = spec.capability
    suffix = "a" if (major, minor) == (9, 0) else ""
    return f"sm_{major}{minor}{suffix}"
