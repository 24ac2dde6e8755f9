"""The small-step MoE decode kernels (moe_decode_gate_up, moe_decode_down) against a torch
reference of the unfused chain and against today's moe_experts, at real Qwen3-30B-A3B,
Qwen1.5-MoE (shared expert + sigmoid gate) and Qwen3.6-35B-A3B (shared expert) shapes, with
non-identity offload expert maps (slots permuted, one routed expert unmapped)."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.kernel import ops
from freetoken.models.forward.moe_decode import VARIANTS
from tests.kernel.moe_decode_ref import assert_within, reference_decode
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (hidden, experts, inter, top_k, shared inter or 0, shared gate)
SHAPES = {
    "qwen3_moe": (2048, 128, 768, 8, 0, False),
    "qwen2_moe": (2048, 60, 1408, 4, 5632, True),
    "qwen3_6_moe": (2048, 256, 512, 8, 512, True),
}
DTYPES = [torch.bfloat16, torch.float16]


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _rnd(g, *shape, scale=1.0):
    """Drawn on the GPU: the expert stacks hold up to half a billion values."""
    return torch.randn(*shape, generator=g, device=_dev()) * scale


class Case:
    """Random weights stored in permuted slots, routing, and the shared expert where asked."""

    def __init__(self, shape: str, tokens: int, dtype, seed: int, crowd: bool = False):
        h, e, i, k, si, gated = SHAPES[shape]
        g = torch.Generator(device=_dev()).manual_seed(seed)
        cpu = torch.Generator().manual_seed(seed)
        self.dtype, self.h, self.i, self.k = dtype, h, i, k
        slots = e + 3
        self.w13 = _rnd(g, slots, 2 * i, h, scale=1 / math.sqrt(h)).to(dtype)
        self.w2 = _rnd(g, slots, h, i, scale=1 / math.sqrt(i)).to(dtype)
        perm = torch.randperm(slots, generator=cpu)[:e].to(torch.int32)
        self.x = _rnd(g, tokens, h).to(dtype)
        logits = torch.randn(tokens, e, generator=cpu)
        if crowd:  # every token routes into the same 2k experts: shared experts across tokens
            logits[:, 2 * k:] -= 100.0
        w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
        self.ids = ids.to(_dev(), torch.int32)
        self.weights = (w / w.sum(-1, keepdim=True)).to(_dev(), torch.float32)
        perm[ids[0, -1]] = -1  # an expert the offload cache computes elsewhere: skipped
        self.emap = perm.to(_dev())
        self.sh = None
        if si:
            self.sh = (_rnd(g, 2 * si, h, scale=1 / math.sqrt(h)).to(dtype),
                       _rnd(g, h, si, scale=1 / math.sqrt(si)).to(dtype),
                       _rnd(g, 1, h, scale=1 / math.sqrt(h)).to(dtype) if gated else None)
        self.ws = torch.empty(tokens * k * i * 2 + 256, dtype=torch.uint8, device=_dev())

    def run(self, out, accumulate=False, variant=0):
        t = self.x.shape[0]
        act = gate = sw13 = sw2 = gw = None
        if self.sh is not None:
            sw13, sw2, gw = self.sh
            act = torch.empty(t, sw2.shape[1], dtype=self.dtype, device=_dev())
            gate = torch.empty(t, 1, dtype=self.dtype, device=_dev()) if gw is not None else None
        ops.moe_decode_gate_up(self.x, self.w13, self.w2, self.ids, self.emap, self.ws, sw13,
                               act, gw, gate, variant)
        ops.moe_decode_down(out, self.w13, self.w2, self.ids, self.weights, self.emap, self.ws,
                            sw2, act, gate, accumulate, variant)
        return out

    def reference(self):
        return reference_decode(self.x, self.w13, self.w2, self.ids, self.weights, self.emap,
                                self.sh)


_assert_within = assert_within


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8])   # every NT the launch dispatches, partial
def test_matches_the_torch_reference(shape, tokens, dtype):
    case = Case(shape, tokens, dtype, seed=tokens)
    out = case.run(torch.empty(tokens, case.h, dtype=dtype, device=_dev()))
    ref, bound = case.reference()
    _assert_within(out, ref, bound)


@pytest.mark.parametrize("variant", range(1, VARIANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_launch_variants_match_the_torch_reference(shape, tokens, variant):
    """The benchmark's other launch shapes; 3 tokens run variant 0 (built for 1-2 only), except
    down's kind-1 variants, which take any step."""
    case = Case(shape, tokens, torch.bfloat16, seed=40 + tokens, crowd=tokens == 2)
    residual = torch.randn(tokens, case.h, device=_dev()).to(torch.bfloat16)
    expect = residual.float().clone()
    case.run(residual, accumulate=True, variant=variant)
    ref, bound = case.reference()
    _assert_within(residual, (expect + ref).to(torch.bfloat16).float(),
                   bound + 2 * EPS["bfloat16"] * expect.abs())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [2, 5, 8])
def test_tokens_sharing_experts(shape, tokens):
    """Every token routed into the same few experts: each is read once, for all its tokens."""
    case = Case(shape, tokens, torch.bfloat16, seed=10 + tokens, crowd=True)
    out = case.run(torch.empty(tokens, case.h, dtype=torch.bfloat16, device=_dev()))
    ref, bound = case.reference()
    _assert_within(out, ref, bound)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_matches_moe_experts(shape, tokens):
    """Against the general kernel (plus the shared expert as the unfused MLP computes it)."""
    case = Case(shape, tokens, torch.bfloat16, seed=20 + tokens)
    out = case.run(torch.empty(tokens, case.h, dtype=torch.bfloat16, device=_dev()))
    t, k, e = tokens, case.k, case.emap.shape[0]
    ws = torch.empty(ops.moe_workspace_bytes(t, k, e, case.i, "bfloat16"), dtype=torch.uint8,
                     device=_dev())
    old = torch.empty_like(out)
    ops.moe_experts(old, case.x, case.w13, case.w2, case.ids, case.weights, case.emap, ws)
    if case.sh is not None:
        sw13, sw2, gw = case.sh
        si = sw2.shape[1]
        gu = case.x @ sw13.T
        s = (torch.nn.functional.silu(gu[:, :si]) * gu[:, si:]) @ sw2.T
        g = torch.sigmoid(case.x @ gw.T) if gw is not None else 1.0
        old = old + g * s
    _, bound = case.reference()
    _assert_within(out, old.float(), 2 * bound)


@pytest.mark.parametrize("shape", ["qwen3_moe", "qwen2_moe"])
def test_accumulate_adds_to_the_residual(shape):
    case = Case(shape, 3, torch.bfloat16, seed=7)
    residual = torch.randn(3, case.h, device=_dev()).to(torch.bfloat16)
    expect = residual.float().clone()
    case.run(residual, accumulate=True)
    ref, bound = case.reference()
    _assert_within(residual, (expect + ref).to(torch.bfloat16).float(),
                   bound + 2 * EPS["bfloat16"] * expect.abs())


def test_graph_replay_follows_new_ids():
    """Captured once, replayed after the routing changed in place: no host-side ids."""
    case = Case("qwen3_moe", 2, torch.bfloat16, seed=3)
    out = torch.empty(2, case.h, dtype=torch.bfloat16, device=_dev())
    case.run(out)  # builds and loads the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.run(out)
    case.ids.copy_(torch.roll(case.ids, 1, dims=0))
    case.weights.copy_(torch.roll(case.weights, 1, dims=0))
    graph.replay()
    torch.cuda.synchronize()
    ref, bound = case.reference()
    _assert_within(out, ref, bound)


def test_bad_arguments_raise():
    case = Case("qwen3_moe", 1, torch.bfloat16, seed=1)
    with pytest.raises(Exception, match="at most 8 tokens"):
        ids = case.ids.repeat(9, 1)
        ops.moe_decode_gate_up(case.x.repeat(9, 1), case.w13, case.w2, ids, case.emap, case.ws)
    with pytest.raises(Exception, match="workspace"):
        ops.moe_decode_gate_up(case.x, case.w13, case.w2, case.ids, case.emap, case.ws[:64])
    with pytest.raises(Exception, match="float32"):
        ops.moe_decode_gate_up(case.x.float(), case.w13, case.w2, case.ids, case.emap, case.ws)
    with pytest.raises(Exception, match="variant"):
        ops.moe_decode_gate_up(case.x, case.w13, case.w2, case.ids, case.emap, case.ws,
                               variant=VARIANTS)
    with pytest.raises(Exception, match="variant"):
        ops.moe_decode_down(torch.empty_like(case.x), case.w13, case.w2, case.ids, case.weights,
                            case.emap, case.ws, variant=VARIANTS)
