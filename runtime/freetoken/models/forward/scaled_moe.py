"""Routed experts over FP8/NVFP4 expert weights kept in their format.

On a GPU (``ScaledExperts``), decode batches (up to ``GEMV_MAX_TOKENS`` tokens) run
``moe_experts_scaled``, which reads only the routed experts' bytes; larger batches dequantize
every slot into the shared scratch and run ``moe_experts``' grouped GEMMs on it (prefill reads
most experts anyway). On the CPU (``HostScaledExperts``: FP8 in a float32 model), the CPU's
``moe_experts_scaled`` serves every batch: it reads each routed expert once per call, however
many tokens it has, where dequantizing a layer's experts would write E times more.
"""

from __future__ import annotations

from typing import Callable

from freetoken.models.forward.scaled_linear import GEMV_MAX_TOKENS, scratch
from freetoken.models.quant.scaled import FP8, NVFP4, ScaledWeight

_FORMAT_IDS = {FP8: 0, NVFP4: 1}


class _Stacked:
    """One stacked expert tensor [S, rows, cols] as the kernels take it."""

    def __init__(self, weight: ScaledWeight):
        import torch

        self.slots, self.rows, self.cols = weight.shape
        self.data = weight.data.view(torch.uint8)
        self.scales = (weight.scales.view(torch.uint8) if weight.format == NVFP4
                       else weight.scales.float().contiguous())
        self.row_scale = weight.row_scale if weight.row_scale is not None else torch.ones(
            self.slots, self.rows, dtype=torch.float32, device=weight.data.device)
        self.block = weight.block

    def args(self) -> tuple:
        return (self.data, self.scales, self.row_scale)

    def flat(self) -> tuple:
        """(data, scales, row_scale) of every slot as one [S * rows, ...] matrix."""
        return (self.data.view(-1, self.data.shape[-1]),
                self.scales.view(-1, self.scales.shape[-1]), self.row_scale.view(-1))


class ScaledKernels:
    """What ScaledExperts launches: moe_experts_scaled (decode steps), scaled_dequantize and
    moe_experts (wider ones). Bound for a device, or given (tests on the CPU pass
    kernel/reference.py's functions)."""

    def __init__(self, gemv: Callable, dequantize: Callable, experts: Callable):
        self.gemv, self.dequantize, self.experts = gemv, dequantize, experts

    @classmethod
    def for_device(cls, device) -> ScaledKernels:
        from freetoken.kernel import ops

        return cls(ops.bind("moe_experts_scaled", device), ops.bind("scaled_dequantize", device),
                   ops.bind("moe_experts", device))


class ScaledExperts:
    """out = the routed SwiGLU experts of x (``ops.moe_experts``'s contract) over scaled
    w13 [S, 2I, H] and w2 [S, H, I] of one format. kernels: bound for the weights' device
    unless given (offloaded experts sit in host memory while the kernels run on the GPU)."""

    def __init__(self, w13: ScaledWeight, w2: ScaledWeight, top_k: int,
                 kernels: ScaledKernels | None = None):
        if w13.format != w2.format:
            raise ValueError(f"expert formats differ: {w13.format} and {w2.format}")
        kernels = kernels or ScaledKernels.for_device(w13.data.device)
        self._gemv, self._experts, self._dequantize = (kernels.gemv, kernels.experts,
                                                        kernels.dequantize)
        self.weights = (w13, w2)      # as given: the expert cache copies their bytes
        self.w13, self.w2 = _Stacked(w13), _Stacked(w2)
        self.format = _FORMAT_IDS[w13.format]
        self.top_k = top_k
        self._act = {}      # dtype -> [GEMV_MAX_TOKENS * K * I] scratch, made on first use

    def __call__(self, out, x, topk_ids, topk_weights, expert_map, workspace) -> None:
        if x.shape[0] <= GEMV_MAX_TOKENS:
            act = self._act.get(x.dtype)
            if act is None:
                import torch

                act = self._act[x.dtype] = torch.empty(
                    GEMV_MAX_TOKENS * self.top_k * self.w2.cols, dtype=x.dtype, device=x.device)
            self._gemv(out, x, *self.w13.args(), *self.w2.args(), self.format, *self.w13.block,
                       *self.w2.block, topk_ids, topk_weights, expert_map, act)
            return
        w13, w2 = self._dequantized(x.dtype, x.device)
        self._experts(out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace)

    def _dequantized(self, dtype, device):
        """Every slot as floats in the shared scratch: ([S, 2I, H], [S, H, I])."""
        a, b = self.w13, self.w2
        size13, size2 = a.slots * a.rows * a.cols, b.slots * b.rows * b.cols
        flat = scratch(device, dtype, size13 + size2)
        w13 = flat[:size13].view(a.slots, a.rows, a.cols)
        w2 = flat[size13:].view(b.slots, b.rows, b.cols)
        for stacked, dst in ((a, w13), (b, w2)):
            if stacked.rows % stacked.block[0] == 0:
                # whole scale blocks per slot: the slots read as one tall matrix, one launch
                self._dequantize(dst.view(-1, stacked.cols), *stacked.flat(), self.format,
                                 *stacked.block)
                continue
            for s in range(stacked.slots):
                self._dequantize(dst[s], stacked.data[s], stacked.scales[s],
                                 stacked.row_scale[s], self.format, *stacked.block)
        return w13, w2


class HostScaledExperts:
    """ScaledExperts' contract on the CPU for FP8 experts w13 [S, 2I, H] and w2 [S, H, I] in
    host memory, x and out float32 (see the module doc)."""

    def __init__(self, w13: ScaledWeight, w2: ScaledWeight, top_k: int):
        from freetoken.kernel import ops
        from freetoken.models.forward.scaled_linear import host_operands

        if not w13.format == w2.format == FP8:
            raise ValueError(f"the CPU's scaled experts take FP8, got {w13.format} and "
                             f"{w2.format}")
        self.weights = (w13, w2)
        self.top_k = top_k
        self._run = ops.bind("moe_experts_scaled", "cpu")
        self._operands = host_operands(w13) + host_operands(w2)
        self._blocks = (*w13.block, *w2.block)

    def __call__(self, out, x, topk_ids, topk_weights, expert_map, workspace) -> None:
        w13, w2 = self._operands[:3], self._operands[3:]
        self._run(out, x, *w13, *w2, 0, *self._blocks, topk_ids, topk_weights, expert_map,
                  workspace)

