"""Host-to-device copies of offloaded experts, launched through the CUDA driver.

A decode step of an offloaded model copies each missed expert as a few spans of pinned host
bytes (gate/up, down, their scales) and uploads each MoE layer's expert -> slot map. Through
torch's ``copy_`` every span cost ~45 us of host time on an H100 host (views, the pinned-memory
check, the host allocator's event bookkeeping): a batch-1 step of the 40-layer Qwen3.6-35B-A3B
at 16 GiB launched 100 of them, 4.5 of its 12.9 ms (`benchmarks/offload_timeline.py`). Here a
span is one ``cuMemcpyHtoDAsync`` call on the cache's copy stream (a ctypes call: expected to
take a few us; not yet measured on a GPU): the bytes, the stream and the ordering are those of
the torch copy it replaces. The host
experts and maps outlive every copy (the cache holds them), so no allocator bookkeeping is
needed.

libcuda.so.1 is the driver's own library, present wherever a CUDA GPU runs; where it cannot be
loaded (ROCm, no GPU) the pools copy through torch as before. Opt-in (FREETOKEN_DRIVER_COPIES=1)
until a GPU run has checked and measured it.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger(__name__)

# (dst base address, dst bytes per slot, src base address, src bytes per expert, span bytes)
Span = tuple[int, int, int, int, int]


class DriverCopyError(RuntimeError):
    """The driver refused a copy (its CUresult named): the cache goes back to torch's copies."""


class DriverCopies:
    """Launches host-to-device spans on one stream (a torch.cuda.Stream)."""

    def __init__(self, torch, stream: Any):
        lib = ctypes.CDLL("libcuda.so.1")
        launch = lib.cuMemcpyHtoDAsync_v2
        launch.argtypes = (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        launch.restype = ctypes.c_int
        self._launch = launch
        self._stream = ctypes.c_void_p(stream.cuda_stream)
        self._current_stream = torch.cuda.current_stream

    @classmethod
    def for_stream(cls, torch, stream: Any) -> DriverCopies | None:
        """Driver copies on `stream`, or None unless FREETOKEN_DRIVER_COPIES=1 asks for them
        and the driver library is CUDA's."""
        from freetoken import env

        if (torch.version.cuda is None or getattr(torch.version, "hip", None)
                or not env.read().driver_copies):
            return None
        try:
            return cls(torch, stream)
        except (OSError, AttributeError) as exc:
            log.info("expert copies go through torch: the CUDA driver library did not load "
                     "(%s)", exc)
            return None

    def copy(self, spans: list[Span], expert: int, slot: int) -> None:
        """Expert `expert`'s spans into pool slot `slot`, on the copy stream."""
        for dst, dst_step, src, src_step, nbytes in spans:
            code = self._launch(dst + slot * dst_step, src + expert * src_step, nbytes,
                                self._stream)
            if code:
                raise DriverCopyError(f"cuMemcpyHtoDAsync of an expert ({nbytes} bytes into "
                                      f"slot {slot}) failed with CUresult {code}")

    def upload(self, dst, src, device: Any) -> None:
        """dst (device) = src (pinned host, as many bytes), on `device`'s current stream: an
        expert map, ordered before the kernel that reads it."""
        nbytes = src.numel() * src.element_size()
        code = self._launch(dst.data_ptr(), src.data_ptr(), nbytes,
                            self._current_stream(device).cuda_stream)
        if code:
            raise DriverCopyError(f"cuMemcpyHtoDAsync of an expert map ({nbytes} bytes) "
                                  f"failed with CUresult {code}")


def span(dst, src) -> Span | None:
    """One part's span: dst [slots, ...] on the device, src [experts, ...] on the host, one
    slot of dst as wide as one expert of src; None unless both are contiguous (the pool then
    copies through torch)."""
    row = src[0].numel() * src.element_size()
    if not (dst.is_contiguous() and src.is_contiguous()
            and dst[0].numel() * dst.element_size() == row):
        return None
    return dst.data_ptr(), row, src.data_ptr(), row, row


def spans_or_none(parts: list[Span | None], nbytes: int) -> tuple[list[Span], int] | None:
    """A pool's copy_spans answer: every part's span and the bytes, or None if one has none."""
    return None if any(p is None for p in parts) else (parts, nbytes)
