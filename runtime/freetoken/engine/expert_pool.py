"""The expert cache's device pool, in the experts' own format, and the kernels that read it.

A pool has T = S + 2E slots: S LRU slots shared by every MoE layer, then two staging buffers
of E slots (engine/expert_cache.py decides what goes where). Every expert also lives in
pinned host memory in the same format, so a miss is a copy of the checkpoint's bytes.

- FloatPool: float experts, w13 [T, 2I, H] and w2 [T, H, I], read by moe_experts through an
  expert -> slot map (a streamed layer's map points at its staging slots).
- BlockPool: GGUF experts kept in their blocks: one uint8 tensor [T, slot_bytes], a slot
  holding an expert's gate/up rows then its down rows in its layer's block types, slot_bytes
  sized for the widest layer's expert (a _K_M mix gives some layers Q6_K down rows). Decode
  steps (up to moe_decode_quant.MAX_TOKENS tokens) read slots slot_bytes apart through
  moe_q8_gate_up / moe_q8_down, the kernels of the resident decode, so an offloaded step
  computes what the resident one does. A streamed layer is copied packed into its staging
  buffer's bytes ([E, 2I, rb13] then [E, H, rb2]), where the wide-step kernels read it
  (dequantized chunks feeding the float grouped GEMM, as resident prefill).
- ScaledPool: FP8 experts kept in their format (e4m3 values, float32 scale grids, row
  scales), one tensor of T slots per part, read through ScaledExperts as resident FP8 layers
  are (models/forward/scaled_moe.py): decode steps (up to scaled_linear.GEMV_MAX_TOKENS
  tokens) through moe_experts_scaled and the expert map; a streamed layer over its staging
  buffer's E slots, wide steps dequantizing those slots for moe_experts.

BlockPool and ScaledPool also compute missed experts on the CPU for co-execution
(offload_policy.py), through the CPU engine's kernels over the same pinned host bytes.
"""

from __future__ import annotations

from typing import Any, Callable

from freetoken.engine.driver_copies import span, spans_or_none


class FloatPool:
    """Float experts: per MoE layer, host w13 [E, 2I, H] and w2 [E, H, I] (pinned on a GPU).
    kernel: moe_experts(out, x, w13, w2, topk_ids, topk_weights, expert_map, workspace)."""

    in_format = False   # float experts: CPU co-execution may compute them
    computes_on_cpu = True     # cpu_experts through torch
    fuses_decode = False   # the decode fusion of moe_decode_quant does not apply

    def __init__(self, host_w13: list, host_w2: list, kernel: Callable):
        self.host_w13, self.host_w2, self.kernel = host_w13, host_w2, kernel
        self.num_layers = len(host_w13)
        self.num_experts, two_i, self.hidden = host_w13[0].shape
        self.inter = two_i // 2
        self.dtype = host_w13[0].dtype
        self.slot_bytes = (host_w13[0][0].numel() + host_w2[0][0].numel()) * \
            host_w13[0].element_size()
        self.pinned_bytes = self.num_layers * self.num_experts * self.slot_bytes
        self.w13 = self.w2 = None
        self._staging_maps: list = []
        self._spans: dict[int, tuple] = {}

    def alloc(self, torch, device, num_slots: int) -> None:
        """Fixed pool tensors of num_slots LRU slots and the staging buffers; the LRU slots
        below the new size keep their data. (Called in inference_mode(False): see
        ExpertCache._alloc.)"""
        total, e = num_slots + 2 * self.num_experts, self.num_experts
        w13 = torch.empty((total, 2 * self.inter, self.hidden), dtype=self.dtype, device=device)
        w2 = torch.empty((total, self.hidden, self.inter), dtype=self.dtype, device=device)
        if self.w13 is not None:
            keep = min(num_slots, self.w13.shape[0] - 2 * e)
            w13[:keep].copy_(self.w13[:keep])
            w2[:keep].copy_(self.w2[:keep])
        self.w13, self.w2, self._spans = w13, w2, {}
        self._staging_maps = [torch.arange(num_slots + b * e, num_slots + (b + 1) * e,
                                           dtype=torch.int32, device=device) for b in range(2)]

    def copy_expert(self, layer: int, expert: int, slot: int) -> int:
        self.w13[slot].copy_(self.host_w13[layer][expert], non_blocking=True)
        self.w2[slot].copy_(self.host_w2[layer][expert], non_blocking=True)
        return self.slot_bytes

    def copy_spans(self, layer: int) -> tuple[list, int] | None:
        """What copy_expert copies, as driver_copies spans, and its bytes (None: copy through
        torch)."""
        if layer not in self._spans:
            self._spans[layer] = spans_or_none([span(self.w13, self.host_w13[layer]),
                                                span(self.w2, self.host_w2[layer])],
                                               self.slot_bytes)
        return self._spans[layer]

    def stage(self, layer: int, buf: int, base: int) -> int:
        """Every expert of `layer` into staging buffer `buf` (slots base .. base + E)."""
        e = self.num_experts
        self.w13[base:base + e].copy_(self.host_w13[layer], non_blocking=True)
        self.w2[base:base + e].copy_(self.host_w2[layer], non_blocking=True)
        return e * self.slot_bytes

    def run_staged(self, layer, buf, base, out, x, topk_ids, topk_weights, workspace,
                   accumulate=False) -> None:
        """The experts of `layer`, staged in buffer `buf` (from slot `base`), for every pair."""
        assert not accumulate, "float experts write out (no fused residual add)"
        self.kernel(out, x, self.w13, self.w2, topk_ids, topk_weights, self._staging_maps[buf],
                    workspace)

    def run_mapped(self, layer, out, x, topk_ids, topk_weights, expert_map, workspace,
                   accumulate=False) -> None:
        assert not accumulate, "float experts write out (no fused residual add)"
        self.kernel(out, x, self.w13, self.w2, topk_ids, topk_weights, expert_map, workspace)

    def max_mapped_tokens(self) -> int | None:
        """The widest step run_mapped takes (None: any)."""
        return None

    def cpu_experts(self, layer: int, x, topk_ids, topk_weights, experts: list[int]):
        """Co-execution's CPU side: float32 [T, H], the pairs routed to `experts` (host x,
        ids and weights), from the host copies (offload_policy.cpu_experts: torch)."""
        from freetoken.engine import offload_policy

        return offload_policy.cpu_experts(x, self.host_w13[layer], self.host_w2[layer],
                                          topk_ids, topk_weights, experts)


class BlockKernels:
    """What BlockPool launches, bound for its device (tests on the CPU pass kernel/reference.py's
    functions): moe_q8_gate_up, moe_q8_down, moe_experts_gguf and a factory of
    dequant.ExpertChunks (None: wide steps always take moe_experts_gguf)."""

    def __init__(self, gate_up: Callable, down: Callable, experts_gguf: Callable,
                 chunks: Callable | None, cpu: Callable | None = None):
        self.gate_up, self.down, self.experts_gguf, self.chunks = \
            gate_up, down, experts_gguf, chunks
        self.cpu = cpu      # the CPU's moe_experts_quant (co-execution), None: never asked

    @classmethod
    def for_device(cls, device, torch_device) -> BlockKernels:
        """device: the model's (kernel binding); torch_device: where the pool lives."""
        from freetoken.kernel import ops
        from freetoken.models.forward.dequant import ExpertChunks

        return cls(ops.bind("moe_q8_gate_up", device), ops.bind("moe_q8_down", device),
                   ops.bind("moe_experts_gguf", device),
                   lambda w13, w2, qtypes: ExpertChunks(w13, w2, qtypes, torch_device),
                   ops.bind("moe_experts_quant", "cpu"))


class BlockPool:
    """GGUF experts in their blocks (see the module doc). Per MoE layer: host w13 uint8
    [E, 2I, rb13] and w2 uint8 [E, H, rb2] in the GPU's row layout (rows padded to 16 bytes,
    models/checkpoint/weights.gpu_rows), pinned on a GPU, and the layer's (qtype13, qtype2)."""

    in_format = True
    fuses_decode = True    # moe_decode_quant's decode hands its routed experts to this pool

    def __init__(self, host_w13: list, host_w2: list, qtypes: list[tuple[int, int]],
                 hidden: int, inter: int, kernels: BlockKernels):
        from freetoken.models.forward import moe_decode_quant

        self.host_w13, self.host_w2, self.qtypes = host_w13, host_w2, qtypes
        self.kernels = kernels
        self.num_layers = len(host_w13)
        self.num_experts = host_w13[0].shape[0]
        self.hidden, self.inter = hidden, inter
        self.bytes13 = [w[0].numel() for w in host_w13]
        self.bytes2 = [w[0].numel() for w in host_w2]
        widest = max(a + b for a, b in zip(self.bytes13, self.bytes2))
        self.slot_bytes = -(-widest // 256) * 256     # whole 256-byte steps: aligned slots
        self.pinned_bytes = self.num_experts * sum(self.bytes13 + self.bytes2)
        self.decode_tokens = moe_decode_quant.MAX_TOKENS
        self.gate_up_rows, self.down_rows = (moe_decode_quant.GATE_UP_ROWS,
                                             moe_decode_quant.DOWN_ROWS)
        self.step_act = moe_decode_quant.step_act
        self.pool = None
        self._identity = None
        self._views: dict[int, tuple[Any, Any]] = {}
        self._spans: dict[int, tuple] = {}

    def alloc(self, torch, device, num_slots: int) -> None:
        total = num_slots + 2 * self.num_experts
        pool = torch.empty((total, self.slot_bytes), dtype=torch.uint8, device=device)
        if self.pool is not None:
            keep = min(num_slots, self.pool.shape[0] - 2 * self.num_experts)
            pool[:keep].copy_(self.pool[:keep])
        self.pool, self._views, self._spans = pool, {}, {}
        if self._identity is None:
            self._identity = torch.arange(self.num_experts, dtype=torch.int32, device=device)

    def _slot_views(self, layer: int):
        """The layer's w13 [T, 2I, rb13] and w2 [T, H, rb2] over every slot (slot_bytes
        apart), as the decode kernels read them."""
        views = self._views.get(layer)
        if views is None:
            total, a, b = self.pool.shape[0], self.bytes13[layer], self.bytes2[layer]
            w13 = self.pool[:, :a].view(total, 2 * self.inter, a // (2 * self.inter))
            w2 = self.pool[:, a:a + b].view(total, self.hidden, b // self.hidden)
            views = self._views[layer] = (w13, w2)
        return views

    def _packed_views(self, layer: int, base: int):
        """The layer's E experts packed from slot `base`'s first byte: w13 [E, 2I, rb13] then
        w2 [E, H, rb2], each contiguous."""
        e, a, b = self.num_experts, self.bytes13[layer], self.bytes2[layer]
        flat = self.pool.view(-1)[base * self.slot_bytes:]
        w13 = flat[:e * a].view(e, 2 * self.inter, a // (2 * self.inter))
        w2 = flat[e * a:e * (a + b)].view(e, self.hidden, b // self.hidden)
        return w13, w2

    def copy_expert(self, layer: int, expert: int, slot: int) -> int:
        a, b = self.bytes13[layer], self.bytes2[layer]
        self.pool[slot, :a].copy_(self.host_w13[layer][expert].view(-1), non_blocking=True)
        self.pool[slot, a:a + b].copy_(self.host_w2[layer][expert].view(-1), non_blocking=True)
        return a + b

    def copy_spans(self, layer: int) -> tuple[list, int] | None:
        """What copy_expert copies, as driver_copies spans (gate/up rows, then down rows, in
        one slot), and its bytes (None: copy through torch)."""
        if layer not in self._spans:
            a, b = self.bytes13[layer], self.bytes2[layer]
            h13, h2 = self.host_w13[layer], self.host_w2[layer]
            base, step = self.pool.data_ptr(), self.slot_bytes
            whole = self.pool.is_contiguous() and h13.is_contiguous() and h2.is_contiguous()
            self._spans[layer] = ([(base, step, h13.data_ptr(), a, a),
                                   (base + a, step, h2.data_ptr(), b, b)], a + b) \
                if whole else None
        return self._spans[layer]

    def stage(self, layer: int, buf: int, base: int) -> int:
        w13, w2 = self._packed_views(layer, base)
        w13.copy_(self.host_w13[layer], non_blocking=True)
        w2.copy_(self.host_w2[layer], non_blocking=True)
        return self.num_experts * (self.bytes13[layer] + self.bytes2[layer])

    def max_mapped_tokens(self) -> int:
        return self.decode_tokens

    @property
    def computes_on_cpu(self) -> bool:
        """Whether cpu_experts can run: the CPU's kernel was given."""
        return self.kernels.cpu is not None

    def cpu_run(self, layer: int):
        """The CPU engine's experts kernel over `layer`'s host blocks, the bytes the cache
        copies (offload_policy.block_runner)."""
        from freetoken.engine import offload_policy

        return offload_policy.block_runner(self.host_w13[layer], self.host_w2[layer],
                                           *self.qtypes[layer], self.kernels.cpu)

    def cpu_experts(self, layer: int, x, topk_ids, topk_weights, experts: list[int]):
        """Co-execution's CPU side: the pairs routed to `experts`, float32 [T, H]."""
        from freetoken.engine import offload_policy

        return offload_policy.cpu_kernel_experts(x, topk_ids, topk_weights, experts,
                                                 self.cpu_run(layer))

    def _decode(self, layer, w13, w2, out, x, topk_ids, topk_weights, expert_map, workspace,
                accumulate) -> None:
        """moe_q8_gate_up then moe_q8_down, as moe_decode_quant.QuantMoEDecode launches them.
        gate/up is not a programmatic dependent: copies on another stream come before it."""
        q13, q2 = self.qtypes[layer]
        act = self.step_act(workspace, x.shape[0] * topk_ids.shape[1], self.inter)
        self.kernels.gate_up(act, x, w13, q13, topk_ids, expert_map, self.gate_up_rows, False)
        self.kernels.down(out, act, w2, q2, topk_ids, topk_weights, expert_map, accumulate,
                          self.down_rows, True)

    def run_mapped(self, layer, out, x, topk_ids, topk_weights, expert_map, workspace,
                   accumulate=False) -> None:
        if x.shape[0] > self.decode_tokens:
            raise ValueError(f"a mapped step over GGUF expert slots takes at most "
                             f"{self.decode_tokens} tokens, got {x.shape[0]} (stream it)")
        w13, w2 = self._slot_views(layer)
        self._decode(layer, w13, w2, out, x, topk_ids, topk_weights, expert_map, workspace,
                     accumulate)

    def run_staged(self, layer, buf, base, out, x, topk_ids, topk_weights, workspace,
                   accumulate=False) -> None:
        w13, w2 = self._packed_views(layer, base)
        if x.shape[0] <= self.decode_tokens:
            self._decode(layer, w13, w2, out, x, topk_ids, topk_weights, self._identity,
                         workspace, accumulate)
            return
        assert not accumulate, "wide steps write out (no fused residual add)"
        chunks = self.kernels.chunks(w13, w2, self.qtypes[layer]) if self.kernels.chunks \
            else None
        if chunks is not None and chunks.applies(x.shape[0]):
            chunks(out, x, topk_ids, topk_weights, self._identity, workspace)
        else:
            self.kernels.experts_gguf(out, x, w13, w2, *self.qtypes[layer], topk_ids,
                                      topk_weights, self._identity, workspace)


class ScaledPool:
    """FP8 or NVFP4 experts in their format (see the module doc). Per MoE layer, host
    ScaledWeight w13 [E, 2I, H] and w2 [E, H, I] (e4m3 values and float32 scale grids, or
    packed e2m1 values and e4m3 scales per 16; float32 row scales or None), pinned on a GPU,
    every layer in one format and layout (``takes``). The pool holds each part as one tensor
    [T, ...]; a slot's row scales are ones where the experts have none (as resident layers
    read them: scaled_moe._Stacked), never copied. The CPU side of co-execution takes FP8
    only (the CPU has no NVFP4 experts kernel)."""

    in_format = True
    fuses_decode = False   # moe_decode_quant's fused decode reads GGUF blocks only

    @staticmethod
    def computes_on_cpu_format(fmt: str) -> bool:
        """Whether the CPU's moe_experts_scaled takes experts of `fmt` (FP8 only)."""
        from freetoken.models.quant.scaled import FP8

        return fmt == FP8

    def __init__(self, host_w13: list, host_w2: list, top_k: int, kernels,
                 cpu: Callable | None = None):
        """kernels: scaled_moe.ScaledKernels, bound for the pool's device; cpu: the CPU's
        moe_experts_scaled (co-execution, FP8 only), None: never asked."""
        from freetoken.models.forward.scaled_linear import GEMV_MAX_TOKENS

        if not self.takes(host_w13, host_w2):
            raise ValueError("the scaled expert pool takes FP8 or NVFP4 experts of one format "
                             "and layout in every layer")
        if cpu is not None and not self.computes_on_cpu_format(host_w13[0].format):
            raise ValueError(f"the CPU computes FP8 experts only, not {host_w13[0].format}")
        self.host_w13, self.host_w2 = host_w13, host_w2
        self.top_k, self.kernels, self.cpu = top_k, kernels, cpu
        self.num_layers = len(host_w13)
        self.num_experts, two_i, self.hidden = host_w13[0].shape
        self.inter = two_i // 2
        self.decode_tokens = GEMV_MAX_TOKENS
        # per layer, the host tensors of the six parts (w13's values, grid and row scales,
        # then w2's); None where the pool's part is ones
        self._host = [_parts(a) + _parts(b) for a, b in zip(host_w13, host_w2)]
        # one slot of each part: (shape, dtype), dtype None for row scales of ones
        self._slot = [(tuple(t.shape[1:]), t.dtype) if t is not None else ((w.rows,), None)
                      for t, w in zip(self._host[0], (host_w13[0],) * 3 + (host_w2[0],) * 3)]
        self.slot_bytes = sum(_count(shape) * (4 if dtype is None else dtype.itemsize)
                              for shape, dtype in self._slot)
        self.pinned_bytes = sum(t.numel() * t.element_size() for parts in self._host
                                for t in parts if t is not None)
        self.parts: list | None = None
        self._identity = None
        self._mapped = None
        self._staged: list = []
        self._cpu_runs: dict[int, Callable] = {}
        self._spans: dict[int, tuple] = {}

    @staticmethod
    def takes(host_w13: list, host_w2: list) -> bool:
        """Whether every layer holds experts of one scaled format and one layout (shapes,
        blocks, scale grids, row scales or none), with the scales its kernel reads (FP8:
        float32 grids; NVFP4: e4m3 per 16 values): what one tensor of slots per part needs."""
        import torch

        from freetoken.models.quant.scaled import FP8, NVFP4, ScaledWeight

        scale_dtype = {FP8: torch.float32, NVFP4: torch.float8_e4m3fn}
        if not host_w13 or len(host_w13) != len(host_w2):
            return False
        first = host_w13[0]
        if not isinstance(first, ScaledWeight) or first.format not in scale_dtype:
            return False
        for weights in (host_w13, host_w2):
            if not all(isinstance(w, ScaledWeight) and w.format == first.format and
                       w.scales.dtype == scale_dtype[first.format] for w in weights):
                return False
            if len({_layout(w) for w in weights}) != 1:
                return False
        return True

    @property
    def format(self) -> str:
        return self.host_w13[0].format

    def alloc(self, torch, device, num_slots: int) -> None:
        """Fixed pool tensors of num_slots LRU slots and the staging buffers; the LRU slots
        below the new size keep their data. (Called in inference_mode(False): see
        ExpertCache._alloc.)"""
        total, e = num_slots + 2 * self.num_experts, self.num_experts
        parts = []
        for i, (shape, dtype) in enumerate(self._slot):
            if dtype is None:
                parts.append(torch.ones((total,) + shape, dtype=torch.float32, device=device))
                continue
            part = torch.empty((total,) + shape, dtype=dtype, device=device)
            if self.parts is not None:
                keep = min(num_slots, self.parts[i].shape[0] - 2 * e)
                part[:keep].copy_(self.parts[i][:keep])
            parts.append(part)
        self.parts, self._spans = parts, {}
        if self._identity is None:
            self._identity = torch.arange(e, dtype=torch.int32, device=device)
        self._mapped = self._experts(0, total)
        self._staged = [self._experts(num_slots + b * e, num_slots + (b + 1) * e)
                        for b in range(2)]

    def _experts(self, start: int, stop: int):
        """The resident FP8 experts' runner (scaled_moe.ScaledExperts) over pool slots
        start .. stop (views: nothing is copied)."""
        from dataclasses import replace

        from freetoken.models.forward.scaled_moe import ScaledExperts

        views = [part[start:stop] for part in self.parts]
        w13, w2 = (replace(w, data=values, scales=grid, row_scale=rows,
                           shape=(stop - start,) + w.shape[1:])
                   for w, (values, grid, rows) in ((self.host_w13[0], views[:3]),
                                                   (self.host_w2[0], views[3:])))
        return ScaledExperts(w13, w2, self.top_k, self.kernels)

    def _copy(self, layer: int, experts, slots) -> int:
        """Host experts `experts` (an index or a slice) of `layer` into pool slots `slots`,
        part by part: the checkpoint's bytes. Returns the bytes copied."""
        moved = 0
        for part, host in zip(self.parts, self._host[layer]):
            if host is not None:
                src = host[experts]
                part[slots].copy_(src, non_blocking=True)
                moved += src.numel() * src.element_size()
        return moved

    def copy_expert(self, layer: int, expert: int, slot: int) -> int:
        return self._copy(layer, expert, slot)

    def copy_spans(self, layer: int) -> tuple[list, int] | None:
        """What copy_expert copies, as driver_copies spans (one per part the host holds),
        and its bytes (None: copy through torch)."""
        if layer not in self._spans:
            parts = [span(part, host) for part, host in zip(self.parts, self._host[layer])
                     if host is not None]
            self._spans[layer] = spans_or_none(parts, sum(p[4] for p in parts if p))
        return self._spans[layer]

    def stage(self, layer: int, buf: int, base: int) -> int:
        """Every expert of `layer` into staging buffer `buf` (slots base .. base + E)."""
        return self._copy(layer, slice(None), slice(base, base + self.num_experts))

    def max_mapped_tokens(self) -> int:
        return self.decode_tokens

    @property
    def computes_on_cpu(self) -> bool:
        """Whether cpu_experts can run: the CPU's kernel was given."""
        return self.cpu is not None

    def cpu_run(self, layer: int):
        """The CPU engine's FP8 experts kernel over `layer`'s host experts, the bytes the cache
        copies (offload_policy.scaled_runner; made once per layer)."""
        from freetoken.engine import offload_policy

        run = self._cpu_runs.get(layer)
        if run is None:
            run = self._cpu_runs[layer] = offload_policy.scaled_runner(
                self.host_w13[layer], self.host_w2[layer], self.cpu)
        return run

    def cpu_experts(self, layer: int, x, topk_ids, topk_weights, experts: list[int]):
        """Co-execution's CPU side: the pairs routed to `experts`, float32 [T, H]."""
        from freetoken.engine import offload_policy

        return offload_policy.cpu_kernel_experts(x, topk_ids, topk_weights, experts,
                                                 self.cpu_run(layer))

    def run_mapped(self, layer, out, x, topk_ids, topk_weights, expert_map, workspace,
                   accumulate=False) -> None:
        assert not accumulate, "FP8 experts write out (no fused residual add)"
        if x.shape[0] > self.decode_tokens:
            raise ValueError(f"a mapped step over FP8 expert slots takes at most "
                             f"{self.decode_tokens} tokens, got {x.shape[0]} (stream it)")
        self._mapped(out, x, topk_ids, topk_weights, expert_map, workspace)

    def run_staged(self, layer, buf, base, out, x, topk_ids, topk_weights, workspace,
                   accumulate=False) -> None:
        """The experts of `layer`, staged in buffer `buf`, as the resident layer runs them
        over its E experts: decode-sized steps read the routed ones, wider steps dequantize
        the buffer's E slots (not the whole pool) for moe_experts."""
        assert not accumulate, "FP8 experts write out (no fused residual add)"
        self._staged[buf](out, x, topk_ids, topk_weights, self._identity, workspace)


def _parts(weight) -> tuple:
    """(values, scale grid, row scales or None) of a stacked ScaledWeight."""
    return (weight.data, weight.scales, weight.row_scale)


def _layout(weight) -> tuple:
    """What every layer's experts must share to fill one pool: shapes, blocks, dtypes."""
    rows = None if weight.row_scale is None else (tuple(weight.row_scale.shape),
                                                  weight.row_scale.dtype)
    return (tuple(weight.shape), weight.block, weight.data.dtype, tuple(weight.scales.shape),
            rows)


def _count(shape: tuple) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
