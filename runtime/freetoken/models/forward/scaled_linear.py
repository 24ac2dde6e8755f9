"""Projections over FP8/NVFP4 weights kept in their own format.

On a GPU (``ScaledLinear``), decode batches (up to ``GEMV_MAX_TOKENS`` rows) run
``scaled_gemv``, which reads the weight's bytes once and applies its scales in registers;
larger batches dequantize the weight into a scratch buffer shared by every layer of the device
and dtype, then multiply on the tensor cores through torch.

On the CPU (``HostScaledLinear``: FP8 in a float32 model; NVFP4 is dequantized at load),
products of up to ``linear.SMALL_PRODUCT_ROWS`` rows run the CPU's ``scaled_gemv`` over the
weight's bytes; longer ones (prefill) dequantize into a shared float32 scratch for BLAS, as
float weights take BLAS there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from freetoken.arrays import array_view, is_torch
from freetoken.models.forward import quant_gemv
from freetoken.models.forward.linear import SMALL_PRODUCT_ROWS
from freetoken.models.quant.scaled import FP8, NVFP4, ScaledWeight

GEMV_MAX_TOKENS = 8        # kernels/cuda/scaled_gemm.cu kMaxTokens
_FORMAT_IDS = {FP8: 0, NVFP4: 1}
# (device, dtype) -> flat scratch tensor, grown to the largest weight it has held.
# NOTE: grows only outside CUDA graph capture in practice: the engine runs a warm-up forward
# of the largest decode batch (every layer) before capturing anything.
_SCRATCH: dict[tuple[Any, Any], Any] = {}
_HOST_SCRATCH: list = []     # the CPU's float32 scratch (a torch tensor), grown to the largest


def scratch(device, dtype, numel: int):
    """A flat buffer of `numel` values on `device`, shared by every scaled op of its dtype."""
    import torch

    key = (device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def kernel_operands(weight: ScaledWeight) -> tuple[Any, Any, Any, tuple[int, int]]:
    """(data bytes, scales, row scales, block) as the scaled GPU kernels take a 2-D weight:
    uint8 data, a float32 grid (FP8) or e4m3 bytes (NVFP4), row scales of ones when it has
    none."""
    import torch

    scales = (weight.scales.view(torch.uint8) if weight.format == NVFP4
              else weight.scales.float().contiguous())
    row_scale = weight.row_scale if weight.row_scale is not None else torch.ones(
        weight.shape[0], dtype=torch.float32, device=weight.data.device)
    return weight.data.view(torch.uint8), scales, row_scale, weight.block


class ScaledLinear:
    """out[T, N] = x[T, K] @ dequant(W).T (+ bias) for a ScaledWeight W [N, K] on a GPU."""

    def __init__(self, weight: ScaledWeight, bias=None):
        from freetoken.kernel import ops

        if len(weight.shape) != 2:
            raise ValueError(f"a scaled projection takes a 2-D weight, got {weight.shape}")
        device = weight.data.device
        self._gemv = ops.bind("scaled_gemv", device)
        self._dequantize = ops.bind("scaled_dequantize", device)
        self.out_features, self.in_features = weight.shape
        self.data, self.scales, self.row_scale, self.block = kernel_operands(weight)
        self.format = _FORMAT_IDS[weight.format]
        self._fp8 = quant_gemv.fp8_decode(self.format, self.block, self.data)
        self.bias = bias

    def __call__(self, out, x) -> None:
        import torch

        if x.shape[0] <= GEMV_MAX_TOKENS and self._fp8 is not None and x.dtype != torch.float32:
            self._fp8(out, x, self.data, self.scales, self.row_scale, *self.block,
                      quant_gemv.fp8_rows(x.shape[0]))
        elif x.shape[0] <= GEMV_MAX_TOKENS:
            self._gemv(out, x, self.data, self.scales, self.row_scale, self.format, *self.block)
        else:
            w = scratch(x.device, x.dtype, self.out_features * self.in_features)
            w = w.view(self.out_features, self.in_features)
            self._dequantize(w, self.data, self.scales, self.row_scale, self.format, *self.block)
            torch.mm(x, w.T, out=out)
        if self.bias is not None:
            out += self.bias


def host_scratch(numel: int):
    """A flat float32 host tensor of `numel` values, shared by every CPU scaled product."""
    import torch

    if not _HOST_SCRATCH or _HOST_SCRATCH[0].numel() < numel:
        _HOST_SCRATCH[:] = [torch.empty(numel, dtype=torch.float32)]
    return _HOST_SCRATCH[0][:numel]


def host_operands(weight: ScaledWeight) -> tuple:
    """An FP8 weight [..., N, K] in host memory as the CPU kernels take it: uint8 codes,
    float32 scale grid and float32 row scales [..., N] (ones where it has none), contiguous
    torch tensors (they reach the kernels without a per-call conversion)."""
    import torch

    rows = weight.row_scale if weight.row_scale is not None else torch.ones(weight.shape[:-1])
    return tuple(t.contiguous() for t in
                 (weight.data.view(torch.uint8), weight.scales.float(), rows.float()))


class HostScaledLinear:
    """out[T, N] = x[T, K] @ dequant(W).T (+ bias) for an FP8 weight W [N, K] in host memory;
    x and out float32, numpy arrays or torch CPU tensors (see the module doc)."""

    def __init__(self, weight: ScaledWeight, bias=None):
        from freetoken.kernel import ops

        if weight.format != FP8 or len(weight.shape) != 2:
            raise ValueError(f"the CPU's scaled projection takes a 2-D FP8 weight, got "
                             f"{weight.format} {weight.shape}")
        self._gemv = ops.bind("scaled_gemv", "cpu")
        self._dequantize = ops.bind("scaled_dequantize", "cpu")
        self.out_features, self.in_features = weight.shape
        self.operands = host_operands(weight)
        self.block = weight.block
        self.bias = bias

    def __call__(self, out, x) -> None:
        out_view, x_view = array_view(out), array_view(x)
        if x_view.shape[0] <= SMALL_PRODUCT_ROWS and _contiguous(x_view) and _contiguous(out_view):
            self._gemv(out, x, *self.operands, 0, *self.block)
        else:
            w = host_scratch(self.out_features * self.in_features).view(
                self.out_features, self.in_features)
            self._dequantize(w, *self.operands, 0, *self.block)
            if is_torch(x_view):        # torch CPU tensors (a GPU's stand-in in tests)
                import torch

                torch.mm(x_view, w.T, out=out_view)
            else:
                np.matmul(x_view, w.numpy().T, out=out_view)
        if self.bias is not None:
            out_view += self.bias


def _contiguous(array) -> bool:
    return array.is_contiguous() if is_torch(array) else array.flags.c_contiguous
