"""One MoE layer's small-step decode (models/forward/moe_decode.py MoEDecode: router GEMV,
top-k, gate/up, down added to the residual) captured in a CUDA graph at P rows, as the engine's
decode graphs capture it, replayed with B <= P real rows and P - B padding rows: the real rows
must come out bitwise as an eager call over just the B rows gives them, replay after replay,
with every scratch buffer poisoned (NaN) before each run, so that a read of something the step
did not write (or a pointer baked at capture into a freed temporary) shows.
tests/kernel/test_moe_decode_padding.py checks the kernel bodies the same way on the host."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch

from freetoken.kernel import ops
from freetoken.models.forward.moe_decode import MoEDecode
from tests.kernel.moe_decode_ref import assert_within, reference_decode
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (hidden, experts, inter, top_k, shared inter or 0, shared gate)
SHAPES = {
    "qwen3_moe": (2048, 128, 768, 8, 0, False),
    "qwen3_6_moe": (2048, 256, 512, 8, 512, True),
}
BF = torch.bfloat16


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _rnd(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g, device=_dev()) * scale).to(BF)


@functools.cache
def _layer(shape: str) -> MoEDecode:
    """A MoEDecode over random weights, built as the decoder's attach() builds it (once per
    shape: it is stateless)."""
    h, e, i, k, si, gated = SHAPES[shape]
    g = torch.Generator(device=_dev()).manual_seed(len(shape))
    w = {"router": _rnd(g, e, h, scale=1 / math.sqrt(h))}
    shared = None
    if si:
        w["shared.gate_up"] = _rnd(g, 2 * si, h, scale=1 / math.sqrt(h))
        w["shared.down"] = _rnd(g, h, si, scale=1 / math.sqrt(si))
        w["shared_gate"] = _rnd(g, 1, h, scale=1 / math.sqrt(h)) if gated else None
        shared = True
    mlp = SimpleNamespace(w13=_rnd(g, e, 2 * i, h, scale=1 / math.sqrt(h)),
                          w2=_rnd(g, e, h, i, scale=1 / math.sqrt(i)), shared=shared,
                          expert_map=torch.arange(e, dtype=torch.int32, device=_dev()),
                          router=None)
    cfg = SimpleNamespace(hidden_size=h, moe=SimpleNamespace(renormalize=True))
    sms = torch.cuda.get_device_properties(_dev()).multi_processor_count
    layer = MoEDecode(mlp, w, cfg, sms, _dev())
    assert layer.gemv_router
    layer.shape = SHAPES[shape]
    return layer


def _buffers(layer: MoEDecode, rows: int) -> SimpleNamespace:
    """The workspace views the step reads and writes (models/forward/workspace.py's names)."""
    h, e, i, k, si, gated = layer.shape
    empty = lambda *s, dtype=BF: torch.empty(*s, dtype=dtype, device=_dev())  # noqa: E731
    return SimpleNamespace(
        x=empty(rows, h), residual=empty(rows, h), router_logits=empty(rows, e),
        topk_weights=empty(rows, k, dtype=torch.float32),
        topk_ids=empty(rows, k, dtype=torch.int32),
        moe_workspace=empty(ops.moe_workspace_bytes(rows, k, e, i, "bfloat16"),
                            dtype=torch.uint8),
        shared_act=empty(rows, si) if si else None,
        shared_gate=empty(rows, 1) if gated else None)


def _poison(b: SimpleNamespace) -> None:
    """Every scratch buffer to all-ones bytes: NaN for the floats, -1 for the ids."""
    for t in (b.router_logits, b.topk_weights, b.topk_ids, b.moe_workspace, b.shared_act,
              b.shared_gate):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


def _step(layer: MoEDecode, b: SimpleNamespace) -> None:
    layer(b.residual, b.x, b, accumulate=True)


def _inputs(layer: MoEDecode, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=_dev()).manual_seed(seed)
    h = layer.shape[0]
    return _rnd(g, rows, h), _rnd(g, rows, h)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _check_sane(layer: MoEDecode, x, before, after, ids, weights) -> None:
    """The eager rows are the MoE MLP added to the residual (the bitwise comparison is not
    between two wrong results); the routing as the step chose it."""
    sh = None
    if layer.shared_w13 is not None:
        sh = (layer.shared_w13, layer.shared_w2, layer.gate_w)
    ref, bound = reference_decode(x, layer.mlp.w13, layer.mlp.w2, ids, weights,
                                  layer.mlp.expert_map, sh)
    expect = (before.float() + ref).to(BF).float()
    assert_within(after, expect, bound + 2 * EPS["bfloat16"] * before.float().abs())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("real,padded", [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4),
                                         (2, 8)])
def test_captured_step_with_padding_rows_is_bitwise_eager(shape, real, padded):
    layer = _layer(shape)
    graph_bufs = _buffers(layer, padded)
    x0, r0 = _inputs(layer, padded, seed=1)
    graph_bufs.x.copy_(x0)
    graph_bufs.residual.copy_(r0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):      # warm-up outside the capture: kernels built and loaded
        _step(layer, graph_bufs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _step(layer, graph_bufs)
    for trial in range(3):
        x, residual = _inputs(layer, padded, seed=10 + trial)
        if padded > real:
            x[real] = 0                   # a padding row of zeros (ties in its router logits)
        graph_bufs.x.copy_(x)
        graph_bufs.residual.copy_(residual)
        _poison(graph_bufs)
        graph.replay()
        eager = _buffers(layer, real)
        eager.x.copy_(x[:real])
        eager.residual.copy_(residual[:real])
        _poison(eager)
        _step(layer, eager)
        torch.cuda.synchronize()
        assert torch.equal(graph_bufs.topk_ids[:real], eager.topk_ids), trial
        assert torch.equal(_bits(graph_bufs.residual[:real]), _bits(eager.residual)), trial
        _check_sane(layer, x[:real], residual[:real], eager.residual, eager.topk_ids,
                    eager.topk_weights)
