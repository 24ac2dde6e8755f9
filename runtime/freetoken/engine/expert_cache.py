"""Offloaded experts: every expert in pinned host memory, the hot ones in one GPU slot pool.

The pool (engine/expert_pool.py: float experts, GGUF experts in their blocks, or FP8 experts
with their scales) has S + 2E slots: S LRU slots shared by every MoE layer
(expert_slots.SlotLRU), then two staging buffers of E slots each. The experts kernel reads
weights through a per-layer expert-id -> slot map (int32 [E] on the device), so the kernel is
the resident one: resident = the identity map over the model's own stacked tensors. Host
copies, slots and every copy hold the experts' own format.

Per MoE layer call (``run``):
- decode (a decode-only step; without the engine's hint, T * K < E): the routing's ids come to
  the host (one small D2H of [T, K], the step's only extra sync per layer); hits keep their
  slot, misses are copied into LRU slots on the copy stream (or, when the co-execution policy
  says so, computed on the CPU from host memory while the GPU runs), the map is uploaded, and
  the kernel waits for the copies' event. When the misses do not fit beside the layer's hits,
  they go through staging buffer 0 instead. A pool whose mapped kernels take a bounded step
  (GGUF blocks: moe_decode_quant.MAX_TOKENS tokens; FP8: scaled_linear.GEMV_MAX_TOKENS)
  streams wider steps.
- decode in CUDA graph segments (engine/segment_graphs.py): the same per layer, but the engine
  calls ``prepare_segment`` between two replays (the ids arrive through a pinned buffer and an
  event), the map is uploaded only when a routed entry changed, and misses are always copied
  (the co-execution policy runs eager steps only).
- prefetch (with predictors, --moe-prefetch on): a decode step also predicts MoE layer l + 1's
  experts from layer l's input (expert_prefetch.NextLayerRouter: the next router over this
  layer's activations), reads those ids with layer l's own (the same sync), and copies the
  predicted misses into LRU slots on the copy stream right behind layer l's misses, so they
  travel while layer l's experts and layer l + 1's attention run. Layer l + 1 finds them as
  hits (waiting for their copies' event only when it routes to one); a wrong guess costs its
  copy and an LRU slot, never a result.
- prefill (a step with a prompt chunk; without the hint, T * K >= E): the layer's experts
  stream whole through the staging buffers, never entering the LRU (no thrashing): layer l
  reads buffer l % 2 while layer l + 1's experts are copied into the other (double buffering).
Indices: `layer` counts MoE layers only (0 .. moe_layers - 1), not decoder layers.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any, Callable

from freetoken.engine.driver_copies import DriverCopies, DriverCopyError
from freetoken.engine.expert_slots import OffloadStats, SlotLRU
from freetoken.engine.offload_policy import CoExecPolicy

log = logging.getLogger(__name__)


class _NoEvent:
    """Stands in for a CUDA event on the CPU (tests), where every copy is synchronous."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class ExpertCache:
    """Args:
        pool: the device pool and its host experts (expert_pool.FloatPool, BlockPool or
            ScaledPool).
        device: torch device of the pool (cuda, or cpu for tests).
        num_slots: LRU slots (cache rate * every expert of every layer).
        policy: co-execution policy (a pool with cpu_experts), or None to copy every miss.
    """

    def __init__(self, pool, device: Any, num_slots: int, policy: CoExecPolicy | None = None):
        import torch

        if policy is not None and not getattr(pool, "computes_on_cpu", False):
            raise ValueError(f"CPU co-execution needs a pool that computes experts on the CPU; "
                             f"this {type(pool).__name__} was given no CPU kernel")
        self.torch, self.device, self.pool, self.policy = torch, device, pool, policy
        self.num_layers, self.num_experts = pool.num_layers, pool.num_experts
        self.hidden, self.inter = pool.hidden, pool.inter
        self.expert_bytes = pool.slot_bytes     # one slot of the device pool
        self.is_cuda = torch.device(device).type == "cuda"
        self.lru = SlotLRU(num_slots)
        self.stats = OffloadStats()
        self._alloc(num_slots)
        e, i32 = self.num_experts, torch.int32
        pin = self.is_cuda
        with torch.inference_mode(False):             # see _alloc
            self.maps_host = [torch.full((e,), -1, dtype=i32, pin_memory=pin)
                              for _ in range(self.num_layers)]
            self.maps_dev = [torch.full((e,), -1, dtype=i32, device=device)
                             for _ in range(self.num_layers)]
        self._maps_np = [m.numpy() for m in self.maps_host]    # views: written in place
        self._maps_list = [[-1] * e for _ in range(self.num_layers)]   # the same, to compare
        if self.is_cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._ready = [torch.cuda.Event() for _ in range(2)]
            self._done = [torch.cuda.Event() for _ in range(2)]
            self._copied = torch.cuda.Event()
            # FREETOKEN_DRIVER_COPIES=1: a miss's spans and the maps through the driver
            self._driver = DriverCopies.for_stream(torch, self.copy_stream)
        else:
            self._driver = None
            self.copy_stream = None
            self._ready = [_NoEvent(), _NoEvent()]
            self._done = [_NoEvent(), _NoEvent()]
            self._copied = _NoEvent()
        self._staged = [-1, -1]        # the MoE layer each staging buffer holds, -1 = none
        # Set by the engine before each forward: True for steps with a prompt chunk (they
        # stream), False for decode-only steps; None: decide by T * K >= E.
        self.prefill: bool | None = None
        # Set while decode graph segments are captured (engine/segment_graphs.py): called with
        # (layer, topk_ids) where a segment ends, before the layer's experts kernel.
        self.segment_hook: Callable[[int, Any], None] | None = None
        self._ids_host = self._ids_np = None   # pinned int32: the routed ids of one layer
        self._ids_views: dict = {}
        self._ids_ready = torch.cuda.Event() if self.is_cuda else _NoEvent()
        # Set by the offload set-up for --moe-prefetch on: predictors[l](x) -> int32 [T, K]
        # ids of MoE layer l + 1 predicted from layer l's input (None: no prediction).
        self.predictors: list[Callable[[Any], Any] | None] = [None] * self.num_layers
        self._prefetched = torch.cuda.Event() if self.is_cuda else _NoEvent()
        self._ahead_layer, self._ahead = -1, set()    # the last prefetch: its layer, experts

    @property
    def in_format(self) -> bool:
        """Whether the pool keeps the experts' format (GGUF blocks or FP8, not floats)."""
        return self.pool.in_format

    @property
    def fuses_decode(self) -> bool:
        """Whether moe_decode_quant's decode step runs on the pool (GGUF blocks only)."""
        return self.pool.fuses_decode

    @property
    def max_mapped_tokens(self) -> int | None:
        """The widest decode step that runs through the slot map (None: any); wider ones
        stream."""
        return self.pool.max_mapped_tokens()

    @property
    def kernel(self) -> Callable:
        """A float pool's moe_experts (tests swap it)."""
        return self.pool.kernel

    @kernel.setter
    def kernel(self, kernel: Callable) -> None:
        self.pool.kernel = kernel

    @property
    def host_w13(self) -> list:
        return self.pool.host_w13

    @property
    def host_w2(self) -> list:
        return self.pool.host_w2

    # ---- pool --------------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.lru.num_slots

    @property
    def pool_bytes(self) -> int:
        return (self.num_slots + 2 * self.num_experts) * self.expert_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.pool.pinned_bytes

    def _staging_base(self, buf: int) -> int:
        return self.num_slots + buf * self.num_experts

    def _alloc(self, num_slots: int) -> None:
        """Fixed pool tensors for `num_slots` LRU slots; cached entries below the new size keep
        their slot and data. NOTE: what the cache writes in place is made a normal tensor even
        in inference mode (capture, a resize): an inference tensor refuses in-place updates
        outside inference mode, and callers may step in either mode."""
        with self.torch.inference_mode(False):
            self.pool.alloc(self.torch, self.device, num_slots)

    def resize(self, num_slots: int) -> None:
        """New pool tensors of `num_slots` LRU slots; call between steps (nothing in flight)."""
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)
        self.lru.resize(num_slots)
        self._alloc(num_slots)
        self._staged = [-1, -1]
        self._ahead_layer, self._ahead = -1, set()

    # ---- one MoE layer -------------------------------------------------------------------------

    def run(self, layer: int, out, x, topk_ids, topk_weights, workspace,
            accumulate: bool = False) -> None:
        """The routed experts of MoE layer `layer` into out (overwritten; accumulate, for an
        in-format pool's decode steps: added to it), as moe_experts."""
        tokens, top_k = topk_ids.shape
        if layer == 0 and self.segment_hook is None:    # segments count in prepare_segment
            self.stats.tokens += tokens
        stream = self.prefill if self.prefill is not None else tokens * top_k >= self.num_experts
        widest = self.max_mapped_tokens
        if stream or (widest is not None and tokens > widest):
            self._stream(layer, out, x, topk_ids, topk_weights, workspace, accumulate)
        else:
            self._decode(layer, out, x, topk_ids, topk_weights, workspace, accumulate)

    def _copy_ctx(self):
        return self.torch.cuda.stream(self.copy_stream) if self.is_cuda \
            else contextlib.nullcontext()

    def _miss_ctx(self):
        """Where misses and prefetches are copied: on the copy stream. Driver copies name it
        themselves, so no stream switch (two torch calls a layer) is made for them; a copy
        that falls back to torch mid-layer then runs on the compute stream, still before the
        kernel."""
        return contextlib.nullcontext() if self._driver is not None else self._copy_ctx()

    def _compute_wait(self, event) -> None:
        if self.is_cuda:
            self.torch.cuda.current_stream(self.device).wait_event(event)

    def _copy_expert(self, layer: int, expert: int, slot: int) -> None:
        """One missed or prefetched expert into `slot`, on the copy stream."""
        spans = self._driver and self.pool.copy_spans(layer)
        if spans:
            try:
                self._driver.copy(spans[0], expert, slot)
                self.stats.bytes_h2d += spans[1]
                return
            except DriverCopyError as exc:
                self._drop_driver(exc)
        self.stats.bytes_h2d += self.pool.copy_expert(layer, expert, slot)

    def _drop_driver(self, exc: DriverCopyError) -> None:
        """A copy the driver refused: torch copies from now on (the refused expert again,
        whole: a span of it the driver did queue gets the same bytes twice)."""
        log.warning("expert copies go back to torch's copy_: %s", exc)
        self._driver = None

    def _stage_layer(self, layer: int, buf: int) -> None:
        """Copy every expert of `layer` into staging buffer `buf` once its last reader is done."""
        with self._copy_ctx():
            if self.is_cuda:
                self.copy_stream.wait_event(self._done[buf])
            self.stats.bytes_h2d += self.pool.stage(layer, buf, self._staging_base(buf))
            self._ready[buf].record(self.copy_stream)
        self._staged[buf] = layer

    def _stream(self, layer, out, x, topk_ids, topk_weights, workspace, accumulate) -> None:
        buf = layer % 2
        if self._staged[buf] != layer:
            self._stage_layer(layer, buf)
        self._compute_wait(self._ready[buf])
        self.pool.run_staged(layer, buf, self._staging_base(buf), out, x, topk_ids,
                             topk_weights, workspace, accumulate)
        if self.is_cuda:
            self._done[buf].record(self.torch.cuda.current_stream(self.device))
        self.stats.streamed_layers += 1
        if layer + 1 < self.num_layers and self._staged[1 - buf] != layer + 1:
            self._stage_layer(layer + 1, 1 - buf)     # overlaps this layer's kernel

    def _decode(self, layer, out, x, topk_ids, topk_weights, workspace, accumulate) -> None:
        predictor = self.predictors[layer]
        routed = topk_ids
        if predictor is not None:     # this layer's ids, then the next layer's predicted ones
            routed = self.torch.cat((topk_ids, predictor(x)), dim=1)
        if self.segment_hook is not None:             # capturing decode graph segments
            self.segment_hook(layer, routed)
            self.pool.run_mapped(layer, out, x, topk_ids, topk_weights, self.maps_dev[layer],
                                 workspace, accumulate)
            return
        both = routed.to("cpu")                       # the one host sync of this layer
        ids = both[:, :topk_ids.shape[1]].contiguous()
        cpu = self._route(layer, ids.numpy(), eager=True)
        if predictor is not None:
            self._prefetch(layer + 1, both[:, topk_ids.shape[1]:].numpy(), layer, ids.numpy())
        host_x = host_w = None
        if cpu:
            host_x, host_w = x.to("cpu"), topk_weights.to("cpu")
        self.pool.run_mapped(layer, out, x, topk_ids, topk_weights, self.maps_dev[layer],
                             workspace, accumulate)
        if cpu:                                       # runs while the GPU computes the rest
            part = self.pool.cpu_experts(layer, host_x, ids, host_w, cpu)
            # NOTE: a blocking copy. A non-blocking one from this pageable temporary (and the
            # bf16 one torch converts it into) may still be reading it when it is freed and
            # reused by the next layer where the driver maps pageable memory for the GPU
            # (HMM); the wait costs only the rest of this layer's experts kernel.
            out.add_(part.to(out.dtype).to(out.device))
            self.stats.cpu_experts += len(cpu)

    def prepare_segment(self, layer: int, topk_ids) -> None:
        """Between two decode graph segments: read MoE layer `layer`'s routed ids (topk_ids:
        the real rows [B, K], still on the device) through a pinned buffer, place its misses
        and make the map the next segment reads current. The segment before must have been
        launched on the current stream; the next one is launched after this returns."""
        shape = tuple(topk_ids.shape)
        host = self._ids_views.get(shape)
        if host is None:
            host = self._ids_view(shape)
        host.copy_(topk_ids, non_blocking=True)
        if self.is_cuda:                              # the one host sync of this layer
            self._ids_ready.record(self.torch.cuda.current_stream(self.device))
            self._ids_ready.synchronize()
        if layer == 0:
            self.stats.tokens += shape[0]
        ids = self._ids_np[:host.numel()].reshape(shape)
        if self.predictors[layer] is None:
            self._route(layer, ids, eager=False)
            return
        half = shape[1] // 2                          # [routed | predicted for layer + 1]
        self._route(layer, ids[:, :half], eager=False)
        self._prefetch(layer + 1, ids[:, half:], layer, ids[:, :half])

    def _ids_view(self, shape: tuple[int, ...]):
        """A pinned int32 view of `shape` (kept per shape: views cost a few us per step)."""
        n = shape[0] * shape[1]
        with self.torch.inference_mode(False):       # written in place by either mode: _alloc
            if self._ids_host is None or self._ids_host.numel() < n:
                self._ids_host = self.torch.empty(n, dtype=self.torch.int32,
                                                  pin_memory=self.is_cuda)
                self._ids_np, self._ids_views = self._ids_host.numpy(), {}
            self._ids_views[shape] = view = self._ids_host[:n].view(shape)
        return view

    def _route(self, layer: int, ids, eager: bool) -> list[int]:
        """Look up MoE layer `layer`'s routed experts (ids: numpy int, any shape), copy the
        misses into slots on the copy stream, make the compute stream wait for them and upload
        the layer's map when it changed. Returns the experts the CPU computes (eager only).

        The map's entries of experts not routed this step are stale but always a slot in range
        (or -1: skipped), so only routed entries are written; eager steps reset the map first,
        as the CPU kernel checks every entry. NOTE: the pinned map is rewritten only after the
        next step's sync on this layer's ids, by which time its last upload has completed."""
        counts = Counter(ids.ravel().tolist())
        hits, missed = self.lru.lookup_layer(layer, counts)
        misses = {e: counts[e] for e in missed}
        self.stats.hits += len(hits)
        self.stats.misses += len(misses)
        if self._ahead_layer == layer:                # hits the last prefetch copied ahead
            ahead = self._ahead.intersection(hits)
            if ahead:
                self.stats.prefetch_hits += len(ahead)
                self._compute_wait(self._prefetched)
        self._ahead_layer, self._ahead = -1, set()
        copy, cpu = (self.policy.split(misses) if self.policy is not None and eager
                     else (sorted(misses), []))
        want = dict.fromkeys(cpu, -1)
        want.update(hits)
        if copy:
            want.update(self._copy_misses(layer, copy, hits))
        emap, mirror = self._maps_np[layer], self._maps_list[layer]
        if eager:
            emap.fill(0)
            mirror[:] = [0] * len(mirror)
        changed = eager
        for e, slot in want.items():
            if mirror[e] != slot:
                mirror[e] = emap[e] = slot
                changed = True
        if changed:                                   # else: all hits in their mapped slots
            self._upload_map(layer)
        return cpu

    def _upload_map(self, layer: int) -> None:
        """maps_dev[layer] = maps_host[layer], on the compute stream (before the kernel)."""
        if self._driver is not None:
            try:
                self._driver.upload(self.maps_dev[layer], self.maps_host[layer], self.device)
                return
            except DriverCopyError as exc:
                self._drop_driver(exc)
        self.maps_dev[layer].copy_(self.maps_host[layer], non_blocking=True)

    def _copy_misses(self, layer: int, copy: list[int], hits: dict[int, int]) -> dict[int, int]:
        """Copy `copy` into LRU slots (evicting none of the layer's hits) or, when they do not
        fit, into staging buffer 0; the compute stream waits for them. Returns expert -> slot."""
        keep, slots = {(layer, e) for e in hits}, {}
        with self._miss_ctx():
            if self.lru.can_place(len(copy), keep):
                for (_, e), slot, _ in self.lru.place([(layer, e) for e in copy], keep):
                    self._copy_expert(layer, e, slot)
                    slots[e] = slot
            else:                                     # overflow: through staging buffer 0
                base, self._staged[0] = self._staging_base(0), -1
                for e in copy:
                    self._copy_expert(layer, e, base + e)
                    slots[e] = base + e
            self._copied.record(self.copy_stream)
        self._compute_wait(self._copied)
        return slots

    def _prefetch(self, layer: int, predicted, current: int, current_ids) -> None:
        """Copy MoE layer `layer`'s predicted experts (numpy ids) that are not cached into LRU
        slots, on the copy stream behind the current layer's misses. Evicts none of the current
        layer's routed experts (its kernel is about to read them) nor the predicted ones already
        cached; a cache too small for them prefetches nothing."""
        if layer >= self.num_layers:
            return
        want = set(predicted.ravel().tolist())
        cached = {e for e in want if (layer, e) in self.lru}
        new = sorted(want - cached)
        if not new:
            return
        keep = {(current, e) for e in set(current_ids.ravel().tolist())}
        keep.update((layer, e) for e in cached)
        if not self.lru.can_place(len(new), keep):
            return
        with self._miss_ctx():
            for (_, e), slot, _ in self.lru.place([(layer, e) for e in new], keep):
                self._copy_expert(layer, e, slot)
            self._prefetched.record(self.copy_stream)
        self._ahead_layer, self._ahead = layer, set(new)
        self.stats.prefetched += len(new)

    def check_integrity(self) -> None:
        self.lru.check_integrity()
