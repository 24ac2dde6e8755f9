"""Projections that write into caller-owned buffers: GGUF blocks through ``quant_matmul``,
float weights through a BLAS matmul (numpy on the CPU, torch on a GPU). Built once at load;
called in the hot loop."""

from __future__ import annotations

import functools

import numpy as np

from freetoken.arrays import HostArrays, array_view, is_torch
from freetoken.models.config import QuantWeight
from freetoken.models.forward import quant_gemv
from freetoken.models.quant.scaled import ScaledWeight
from freetoken.models.checkpoint.weights import Array, Weight


class DenseLinear:
    """out[T, N] = x[T, K] @ W.T (+ bias) for a float weight W [N, K]."""

    def __init__(self, weight: Array, bias: Array | None = None):
        self.weight_t = weight.T        # a view: the matmul reads the transposed layout directly
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._torch = None
        if is_torch(weight):
            import torch

            self._torch = torch

    def __call__(self, out: Array, x: Array) -> None:
        if self._torch is not None:
            if self.bias is None:
                self._torch.mm(x, self.weight_t, out=out)
            else:
                self._torch.addmm(self.bias, x, self.weight_t, out=out)
            return
        out = array_view(out)
        np.matmul(array_view(x), self.weight_t, out=out)
        if self.bias is not None:
            out += self.bias


# GGUF types whose rows the CPU repacks 16 wide at load (kernels/include/freetoken/quant_packed.h)
PACKED_TYPES = (2, 3, 8)    # Q4_0, Q4_1, Q8_0


@functools.cache
def _cpu_has_vnni512() -> bool:
    from freetoken.kernel import ops

    return ops.cpu_isa() == "avx512"


def packs_on_cpu(qtype: int, rows: int) -> bool:
    """Whether a CPU projection of this GGUF type and row count is repacked at load: on an
    AVX-512 VNNI CPU, for whole tiles of 16 rows, unless FREETOKEN_CPU_PACK=0 or a test runs
    the reference quant_matmul in its place."""
    from freetoken import env
    from freetoken.kernel import ops

    return (qtype in PACKED_TYPES and rows % 16 == 0 and env.read().cpu_pack
            and getattr(ops.quant_matmul, "__module__", None) == ops.__name__
            and _cpu_has_vnni512())


class QuantLinear:
    """out[T, N] = x[T, K] @ dequant(W).T (+ bias) on GGUF blocks, never dequantized: f32 on the
    CPU (quant_matmul, or quant_matmul_packed over a copy repacked at load: packs_on_cpu); bf16 x
    and a bf16 or f32 out on a GPU (gguf_matmul, which also writes into a column slice of a
    wider out: ``strided_out``)."""

    def __init__(self, weight: QuantWeight, bias: Array | None = None):
        from freetoken.kernel import ops

        self.strided_out = is_torch(weight.data)
        self.packed = False
        self._gemv = None
        if self.strided_out:
            self._matmul = ops.bind("gguf_matmul", weight.data.device)
            self._gemv = quant_gemv.gguf_decode(weight.qtype, weight.data)
            self.data = weight.data
        elif packs_on_cpu(weight.qtype, weight.shape[0]):
            # a copy in anonymous memory; the file's pages stay mapped for whoever else reads
            # them (a tied embedding)
            packed = np.empty(weight.data.shape, dtype=np.uint8)
            ops.bind("quant_pack", "cpu")(HostArrays.kernel_arg(packed),
                                          HostArrays.kernel_arg(weight.data), weight.qtype)
            self._matmul = ops.bind("quant_matmul_packed", "cpu")
            self.packed = True
            self.data = HostArrays.kernel_arg(packed)
        else:
            self._matmul = ops.bind("quant_matmul", "cpu")
            self.data = HostArrays.kernel_arg(weight.data)
        self.qtype, self.bias = weight.qtype, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, out: Array, x: Array) -> None:
        if self._gemv is not None and x.shape[0] <= 8:     # quant_gemv.GEMV_MAX_TOKENS
            self._gemv(out, x, self.data, self.qtype, quant_gemv.gguf_rows(self.qtype, x.shape[0]))
        else:
            self._matmul(out, x, self.data, self.qtype)
        if self.bias is not None:
            array_view(out)[...] += self.bias


class PartsLinear:
    """Row blocks that could not be concatenated (mixed GGUF types, as in the _M mixes): one
    product per part. A part that writes strided rows (gguf_matmul) writes its columns in place.

    # NOTE: other parts allocate a scratch output per call; only unusual files take that path.
    """

    def __init__(self, parts: list, bias: Array | None = None):
        self.parts = parts
        self.bias = bias
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, out: Array, x: Array) -> None:
        out = array_view(out)
        col = 0
        for part in self.parts:
            columns = out[:, col:col + part.out_features]
            if getattr(part, "strided_out", False):
                part(columns, x)
                col += part.out_features
                continue
            scratch = columns.clone() if is_torch(columns) else columns.copy()
            part(scratch, x)
            out[:, col:col + part.out_features] = scratch
            col += part.out_features
        if self.bias is not None:
            out += self.bias


def make_linear(weights: Weight | list[Weight], bias: Array | None = None):
    """The projection for one weight, or for row parts that the loader kept apart."""
    if isinstance(weights, list):
        if len(weights) == 1:
            return make_linear(weights[0], bias)
        return PartsLinear([make_linear(w) for w in weights], bias)
    if isinstance(weights, QuantWeight):
        return QuantLinear(weights, bias)
    if isinstance(weights, ScaledWeight):
        from freetoken.models.forward.scaled_linear import ScaledLinear

        return ScaledLinear(weights, bias)
    return DenseLinear(weights, bias)
