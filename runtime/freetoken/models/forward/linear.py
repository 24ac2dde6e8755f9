"""Projections that write into caller-owned buffers: GGUF blocks through ``quant_matmul``,
float weights through a BLAS matmul (numpy on the CPU, torch on a GPU). Built once at load;
called in the hot loop."""

from __future__ import annotations

import functools
import math

import numpy as np

from freetoken.arrays import HostArrays, array_view, is_torch
from freetoken.models.config import QuantWeight
from freetoken.models.forward import dequant, quant_gemv
from freetoken.models.forward.dequant import DequantScratch
from freetoken.models.quant.scaled import ScaledWeight
from freetoken.models.checkpoint.weights import Array, Weight


# A CPU float product of up to this many activation rows runs on the kernels' own pool
# (float_matmul) instead of BLAS, whose threads spin for a while after every call and take the
# cores from that pool's workers on a small machine; larger products (prefill) are BLAS's
# strength, except through the small weights an MoE layer calls every step (router, shared-
# expert gate: `every_step`), which would leave BLAS spinning into the decode that follows.
SMALL_PRODUCT_ROWS = 8


class DenseLinear:
    """out[T, N] = x[T, K] @ W.T (+ bias) for a float weight W [N, K]."""

    def __init__(self, weight: Array, bias: Array | None = None, every_step: bool = False):
        self.weight_t = weight.T        # a view: the matmul reads the transposed layout directly
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._torch = None
        self._small = None
        if is_torch(weight):
            import torch

            self._torch = torch
        elif weight.flags.c_contiguous and weight.dtype in (np.float32, np.float16):
            from freetoken.kernel import ops

            if getattr(ops.float_matmul, "__module__", None) == ops.__name__:  # not replaced
                self._small = ops.bind("float_matmul", "cpu")
                self._weight = HostArrays.kernel_arg(weight)
                self._small_rows = math.inf if every_step else SMALL_PRODUCT_ROWS

    def __call__(self, out: Array, x: Array) -> None:
        if self._torch is not None:
            if self.bias is None:
                self._torch.mm(x, self.weight_t, out=out)
            else:
                self._torch.addmm(self.bias, x, self.weight_t, out=out)
            return
        out, x = array_view(out), array_view(x)
        if (self._small is not None and x.shape[0] <= self._small_rows
                and x.dtype == out.dtype == np.float32
                and x.flags.c_contiguous and out.flags.c_contiguous):
            self._small(out, x, self._weight)
        else:
            np.matmul(x, self.weight_t, out=out)
        if self.bias is not None:
            out += self.bias


# GGUF types whose rows the CPU repacks 16 wide at load (kernels/include/freetoken/quant_packed.h)
PACKED_TYPES = (2, 3, 6, 7, 8, 12, 14)    # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K


@functools.cache
def _cpu_has_vnni512() -> bool:
    from freetoken.kernel import ops

    return ops.cpu_isa() == "avx512"


def packs_on_cpu(qtype: int, rows: int, op: str = "quant_matmul") -> bool:
    """Whether CPU weights of this GGUF type are repacked at load for `op`: on an AVX-512 VNNI
    CPU, where every product starts on a whole tile (`rows` a multiple of 16), unless
    FREETOKEN_CPU_PACK=0 or a test runs the reference `op` in its place."""
    from freetoken import env
    from freetoken.kernel import ops

    return (qtype in PACKED_TYPES and rows % 16 == 0 and env.read().cpu_pack
            and getattr(getattr(ops, op), "__module__", None) == ops.__name__
            and _cpu_has_vnni512())


def packed_copy(data: np.ndarray, qtype: int) -> np.ndarray:
    """GGUF rows (any leading axes; rows per leading index a multiple of 16) rewritten by
    quant_pack into new memory. Rows read from the file's mapping have their pages dropped
    from this process afterwards, so the model is not held twice; a tied embedding that reads
    them later maps them again."""
    from freetoken.kernel import ops
    from freetoken.models.checkpoint.gguf_file import release_view

    packed = np.empty(data.shape, dtype=np.uint8)
    row_bytes = data.shape[-1]
    ops.bind("quant_pack", "cpu")(HostArrays.kernel_arg(packed.reshape(-1, row_bytes)),
                                  HostArrays.kernel_arg(data.reshape(-1, row_bytes)), qtype)
    release_view(data)
    return packed


def _bf16_vector(t) -> bool:
    return (is_torch(t) and str(t.dtype) == "torch.bfloat16" and t.dim() == 1
            and t.is_contiguous() and t.data_ptr() % 16 == 0)


class QuantLinear:
    """out[T, N] = x[T, K] @ dequant(W).T (+ bias) on GGUF blocks, never dequantized at load: f32
    on the CPU (quant_matmul, or quant_matmul_packed over a copy repacked at load:
    packs_on_cpu); bf16 x and a bf16 or f32 out on a GPU, which may be a column slice of a wider
    out (``strided_out``): gguf_gemv_q8 at 1-8 tokens (1-2 for the types without its 8-token
    kernels, and fewer where x outgrows its staging), gguf_gemv at 3-4, the float GEMM over the weight dequantized into
    the device's scratch above (dequant.py), gguf_matmul where the scratch does not hold it."""

    def __init__(self, weight: QuantWeight, bias: Array | None = None):
        from freetoken.kernel import ops

        self.strided_out = is_torch(weight.data)
        self.packed = False
        self._gemv = self._q8 = self._scratch = None
        if self.strided_out:
            self._matmul = ops.bind("gguf_matmul", weight.data.device)
            self._gemv = quant_gemv.gguf_decode(weight.qtype, weight.data)
            self._q8 = quant_gemv.q8_decode(weight.qtype, weight.shape[1], weight.data)
            self.data = weight.data
            if weight.data.device.type == "cuda" and len(weight.shape) == 2:
                # prefill steps dequantize into the device's shared scratch where it holds
                # the weight (dequant.py; the decoder sizes it)
                self._scratch = DequantScratch.for_device(weight.data.device)
                self._dequantize = ops.bind("gguf_dequantize", weight.data.device)
        elif packs_on_cpu(weight.qtype, weight.shape[0]):
            self._matmul = ops.bind("quant_matmul_packed", "cpu")
            self.packed = True
            self.data = HostArrays.kernel_arg(packed_copy(weight.data, weight.qtype))
        else:
            self._matmul = ops.bind("quant_matmul", "cpu")
            self.data = HostArrays.kernel_arg(weight.data)
        self.qtype, self.bias = weight.qtype, bias
        self.out_features, self.in_features = weight.shape
        # the most tokens gguf_gemv_q8 takes for this weight (0: none), decided once. Wider
        # steps dequantize for cuBLAS: several launches of the widest step (each reading the
        # blocks) lost on the H200 at batch 32 (Qwen3-8B Q4_K_M: 4,668 against 7,119 tok/s)
        self._q8_tokens = 0 if self._q8 is None else quant_gemv.q8_max_tokens(
            self.qtype, self.in_features)
        # gguf_gemv_q8 adds a bf16 bias in its epilogue; another keeps the add after it
        self._q8_bias = bias if self._q8 is not None and _bf16_vector(bias) else None

    def __call__(self, out: Array, x: Array) -> None:
        tokens = x.shape[0]
        if 0 < tokens <= self._q8_tokens:
            self._q8(out, x, self.data, self.qtype, self._q8_bias, None, 0.0,
                     quant_gemv.Q8_STORE, 0, False)
            if self._q8_bias is None and self.bias is not None:
                array_view(out)[...] += self.bias
            return
        if (self._scratch is not None and tokens > dequant.MIN_TOKENS
                and self._scratch.holds(self.out_features * self.in_features)):
            dequant.dense_product(out, x, self.data, self.qtype, self._scratch, self._dequantize)
        elif self._gemv is not None and tokens <= quant_gemv.GEMV_MAX_TOKENS:
            self._gemv(out, x, self.data, self.qtype, quant_gemv.gguf_rows(self.qtype, tokens))
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


def make_linear(weights: Weight | list[Weight], bias: Array | None = None,
                every_step: bool = False):
    """The projection for one weight, or for row parts that the loader kept apart; `every_step`:
    a small float weight every step calls (see SMALL_PRODUCT_ROWS)."""
    if isinstance(weights, list):
        if len(weights) == 1:
            return make_linear(weights[0], bias)
        return PartsLinear([make_linear(w) for w in weights], bias)
    if isinstance(weights, QuantWeight):
        return QuantLinear(weights, bias)
    if isinstance(weights, ScaledWeight):
        from freetoken.models.forward.scaled_linear import HostScaledLinear, ScaledLinear

        if weights.data.device.type == "cpu":
            return HostScaledLinear(weights, bias)
        return ScaledLinear(weights, bias)
    return DenseLinear(weights, bias, every_step)
