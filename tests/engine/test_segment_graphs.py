"""How SegmentedDecodeGraphs cuts a forward and replays it, on the CPU: stand-in graphs record
the work captured into them, a stand-in model logs its stages and calls the expert cache's
segment hook where the real MoE layer does, and a stand-in cache logs prepare_segment. The
replay must interleave as "segment 0, prepare layer 0 (real rows), segment 1, ..., segment L",
each segment holding exactly the work between two routing points."""

from __future__ import annotations

import types

import pytest
import torch

from freetoken.engine import segment_graphs
from freetoken.engine.segment_graphs import SegmentedDecodeGraphs
from freetoken.models.batch import ForwardBatch

LAYERS = 3
LOG: list[str] = []


class FakeGraph:
    capturing = None

    def __init__(self):
        self.work: list[str] = []

    def capture_begin(self, pool=None):
        assert FakeGraph.capturing is None, "nested capture"
        FakeGraph.capturing = self

    def capture_end(self):
        assert FakeGraph.capturing is self
        FakeGraph.capturing = None

    def replay(self):
        LOG.extend(self.work)


def run(stage: str) -> None:
    """A kernel launch: recorded into the graph being captured, else run (logged) now."""
    (FakeGraph.capturing.work if FakeGraph.capturing else LOG).append(stage)


class FakeCache:
    num_layers, policy, prefill, segment_hook = LAYERS, None, None, None
    max_mapped_tokens = None

    def prepare_segment(self, layer, topk_ids):
        LOG.append(f"prepare {layer} rows {topk_ids.shape[0]}")


class FakeModel:
    def __init__(self, cache, moe_layers=LAYERS):
        self.cache, self.moe_layers = cache, moe_layers
        self.arrays = types.SimpleNamespace(torch_device=torch.device("cpu"))

    def forward(self, batch, kv):
        tokens = batch.input_ids.shape[0]
        run("embed")
        for layer in range(self.moe_layers):
            run(f"attn+route {layer}")
            self.cache.segment_hook(layer, torch.zeros(tokens, 2, dtype=torch.int32))
            run(f"experts {layer}")
        run("head")
        return torch.zeros(tokens, 5)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(segment_graphs.torch.cuda, "CUDAGraph", FakeGraph)
    LOG.clear()
    cache = FakeCache()
    kv = types.SimpleNamespace(num_state_slots=0)
    return SegmentedDecodeGraphs(FakeModel(cache), kv, max_batch=4, max_blocks=2, cache=cache)


def decode_batch(b: int) -> ForwardBatch:
    z = torch.zeros(b, dtype=torch.int64)
    return ForwardBatch(z, z, z, torch.zeros((b, 1), dtype=torch.int32),
                        torch.ones(b, dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32),
                        torch.arange(b), max_query_len=1)


def test_a_step_replays_one_segment_per_routing_point_with_the_bookkeeping_between(graphs):
    for size in graphs.sizes:
        graphs._capture_size(size, pool=None)
    assert graphs.sizes == [1, 2, 4]
    assert [g.work for g in graphs.segments[4]] == [
        ["embed", "attn+route 0"], ["experts 0", "attn+route 1"],
        ["experts 1", "attn+route 2"], ["experts 2", "head"]]
    LOG.clear()
    logits = graphs.run(decode_batch(3))             # padded to the graph of 4
    assert logits.shape == (3, 5)
    assert LOG == ["embed", "attn+route 0", "prepare 0 rows 3",
                   "experts 0", "attn+route 1", "prepare 1 rows 3",
                   "experts 1", "attn+route 2", "prepare 2 rows 3",
                   "experts 2", "head"]
    assert graphs.slot_mapping[3] == -1              # the padding row stores no KV


def test_a_capture_that_misses_a_moe_layer_is_refused(graphs):
    graphs.model.moe_layers = LAYERS - 1
    with pytest.raises(RuntimeError, match="captured 2 MoE layers of 3"):
        graphs._capture_size(1, pool=None)
    assert FakeGraph.capturing is None


def test_a_capture_that_fails_midway_leaves_capture_mode(graphs):
    def failing_forward(batch, kv):
        run("embed")
        graphs.cache.segment_hook(0, torch.zeros(1, 2, dtype=torch.int32))
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs.model.forward = failing_forward
    with pytest.raises(RuntimeError, match="not permitted"):
        graphs._capture_size(1, pool=None)
    assert FakeGraph.capturing is None and 1 not in graphs.segments


def test_co_execution_keeps_steps_eager(graphs):
    graphs._capture_size(1, pool=None)
    assert graphs.can_run(decode_batch(1))
    graphs.cache.policy = object()
    assert not graphs.can_run(decode_batch(1))


def test_a_failed_capture_falls_back_to_eager_decode(graphs, monkeypatch, caplog):
    def fail(self):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(SegmentedDecodeGraphs, "capture", fail)
    monkeypatch.setattr(segment_graphs.torch.cuda, "synchronize", lambda: None)
    kv = types.SimpleNamespace(num_state_slots=0)
    with caplog.at_level("WARNING"):
        got = segment_graphs.capture_decode_graphs(graphs.model, kv, 4, 2, graphs.cache)
    assert got is None and "decode runs eagerly" in caplog.text


def test_batches_wider_than_the_mapped_kernels_take_run_eagerly(monkeypatch):
    """A pool whose mapped kernels take at most 2 tokens (FP8: 8) streams wider decode steps
    through its staging buffers, with no routing point to cut at: no graph is captured for
    them, so they run eagerly."""
    monkeypatch.setattr(segment_graphs.torch.cuda, "CUDAGraph", FakeGraph)
    cache = FakeCache()
    cache.max_mapped_tokens = 2
    kv = types.SimpleNamespace(num_state_slots=0)
    graphs = SegmentedDecodeGraphs(FakeModel(cache), kv, max_batch=4, max_blocks=2, cache=cache)
    assert graphs.sizes == [1, 2]
    assert graphs.can_run(decode_batch(2)) and not graphs.can_run(decode_batch(3))
