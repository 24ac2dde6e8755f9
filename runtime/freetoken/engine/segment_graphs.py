"""Decode with offloaded experts in CUDA graph segments.

A decode step with an expert cache learns each MoE layer's routing on the host mid-step, so it
cannot be one graph. Per decode batch size, the forward is captured as L + 1 graphs (L MoE
layers), cut just before each layer's experts kernel:

    segment 0      embedding, layers up to MoE layer 0's router and top-k
    segment l      MoE layer l-1's experts (through the slot map maps_dev[l-1]), the rest of
                   its decoder layer, everything up to MoE layer l's router and top-k
    segment L      MoE layer L-1's experts, the last layers, final norm and LM head

Between segment l and l + 1 only the host's expert bookkeeping runs
(ExpertCache.prepare_segment): copy layer l's top-k ids into a pinned buffer and wait on an
event (the one sync of the layer), update the LRU, launch the misses' copies on the copy
stream and make the compute stream wait for them, and upload maps_dev[l] when a routed entry
changed. Every kernel is the one the resident graph runs (the experts kernel reads the pool
through the map instead of the stacked weights through the identity), so the logits are the
resident graph's, bit for bit.

Cost over the resident graph, per MoE layer, when every expert hits: the GPU idles from the
end of segment l until segment l + 1 starts: the event wake (~5 us), the D2H launch (~3 us),
the LRU look-ups (benchmarks/offload_bookkeeping.py: ~9 us at batch 1, ~50 us at batch 8 with
top-8 of 128 on a busy 2-core host) and the graph launch (~5 us); no map upload when nothing
moved. So ~20-30 us per layer at batch 1: 12 layers add ~0.3 ms to a ~1.6 ms resident step.

With misses, segment l + 1 waits for all of layer l's copies: the experts that hit do not
start early, as splitting the experts kernel into hits and misses would add two bf16 partial
sums (not the resident rounding). At low cache rates the step is bound by the copies (misses
x expert bytes / H2D bandwidth, ~115 us per 6 MiB expert at 55 GB/s), of which a layer's own
GPU work (tens of us) could hide only a few percent.

Padding rows (a batch of B < size) route on garbage: only the first B rows' ids are looked up;
the padding rows' experts read whatever slot their stale map entry names (always a slot in
range), and their logits are dropped.
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.models.batch import ForwardBatch, KVCache

log = logging.getLogger(__name__)


class SegmentedDecodeGraphs(DecodeGraphs):
    """DecodeGraphs for a model whose MoE layers run through `cache` (an ExpertCache)."""

    def __init__(self, model, kv: KVCache, max_batch: int, max_blocks: int, cache):
        # a decode step wider than the pool's mapped kernels take (FP8: 8 tokens) streams
        # every layer through the staging buffers, with no routing to cut at: it runs eagerly
        widest = cache.max_mapped_tokens
        super().__init__(model, kv, max_batch if widest is None else min(max_batch, widest),
                         max_blocks)
        self.cache = cache
        self.segments: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # per size, per MoE layer: the workspace's top-k ids the segments write (device)
        self.topk_ids: dict[int, list[torch.Tensor]] = {}
        self._real_rows: dict[tuple[int, int], list[torch.Tensor]] = {}

    def capture(self) -> SegmentedDecodeGraphs:
        start, cache = time.perf_counter(), self.cache
        saved = cache.prefill, cache.stats
        cache.stats = copy.copy(saved[1])     # warm-up and capture steps are not counted
        cache.prefill = False                 # whatever T * K is, these are decode steps
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                for size in reversed(self.sizes):     # largest first, as DecodeGraphs
                    cache.segment_hook = cache.prepare_segment   # warm-up: eager, same path
                    self.model.forward(self._static_batch(size), self.kv)
                    torch.cuda.synchronize()
                    self._capture_size(size, pool)
        finally:
            cache.segment_hook = None
            cache.prefill, cache.stats = saved
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured offloaded decode in %d segments per batch size (%s) in %.2f s",
                 cache.num_layers + 1, ",".join(map(str, self.sizes)), self.capture_seconds)
        return self

    def _capture_size(self, size: int, pool) -> None:
        graphs: list[torch.cuda.CUDAGraph] = []
        ids: list[torch.Tensor] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)

        def cut(layer: int, topk_ids: torch.Tensor) -> None:
            if layer != len(ids):
                raise RuntimeError(f"MoE layer {layer} ran out of order (expected {len(ids)})")
            ids.append(topk_ids)
            graphs[-1].capture_end()
            begin()

        self.cache.segment_hook = cut
        begin()
        try:
            self.outputs[size] = self.model.forward(self._static_batch(size), self.kv)
        except BaseException:
            try:                # leave capture mode; the capture itself is already invalid
                graphs[-1].capture_end()
            except RuntimeError:
                pass
            raise
        graphs[-1].capture_end()
        if len(ids) != self.cache.num_layers:
            raise RuntimeError(f"captured {len(ids)} MoE layers of {self.cache.num_layers}")
        self.segments[size], self.topk_ids[size] = graphs, ids
        self.graphs[size] = graphs[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        # the co-execution policy computes misses on the CPU mid-layer: eager steps only
        return self.cache.policy is None and super().can_run(batch)

    def run(self, batch: ForwardBatch, previous_tokens: torch.Tensor | None = None
            ) -> torch.Tensor:
        size = self.load_inputs(batch, previous_tokens)
        b = batch.num_seqs
        rows = self._real_rows.get((size, b))
        if rows is None:        # the real rows' views, made once (a view costs a few us)
            rows = self._real_rows[size, b] = [ids[:b] for ids in self.topk_ids[size]]
        segments = self.segments[size]
        for layer, graph in enumerate(segments[:-1]):
            graph.replay()
            self.cache.prepare_segment(layer, rows[layer])
        segments[-1].replay()
        return self.outputs[size][:b]


def capture_decode_graphs(model, kv: KVCache, max_batch: int, max_blocks: int, cache=None,
                          verify: tuple[int, int] = (0, 0)) -> DecodeGraphs | None:
    """Whole-step decode graphs (and verify graphs for `verify` = (K, the most tokens a step
    may take); K = 0: none), or with an expert cache the segmented ones; None (eager decode)
    when an offloaded model's capture fails."""
    if cache is None:
        return DecodeGraphs(model, kv, max_batch, max_blocks, *verify).capture()
    try:
        return SegmentedDecodeGraphs(model, kv, max_batch, max_blocks, cache).capture()
    except RuntimeError as exc:     # torch reports capture failures as RuntimeError
        log.warning("offloaded decode runs eagerly: capturing its graph segments failed (%s)",
                    exc)
        torch.cuda.synchronize()
        return None
