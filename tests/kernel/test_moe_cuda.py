"""The CUDA MoE kernels (routing and routed experts) against a float64 torch reference.

Error bounds are derived, not tuned: the experts kernel rounds the SwiGLU activations to the
input dtype before the down projection (as HF transformers does) and the output once; each
rounding is at most the dtype's unit roundoff u relative, so |out - ref| is bounded by
u * sum_k |w| (|W2| @ |act|) + u * |ref| plus f32 accumulation terms that scale with sqrt(H) and
sqrt(I). A second, tighter check holds the RMS error to the random-walk size of those roundings.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernel import ops

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
EPS32 = 2.0 ** -24


def gpu(fn):
    """Mark a test as needing a CUDA GPU; it skips cleanly without one."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(fn))


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


# ---------------------------------------------------------------- references

def reference_experts(x, w13, w2, ids, weights, expert_map, weight_unit=0.0):
    """(ref, round_bound, acc_bound, walk) in float64: the contract's formula; worst-case bounds
    for the kernel's dtype roundings and for its f32 accumulation; the per-element size of the
    roundings' random walk. weight_unit: the relative rounding of the weights inside the kernel
    (a kernel that decodes quantized weights to bf16 tiles), added to round_bound."""
    T, H = x.shape
    inter = w2.shape[2]
    u = UNIT[x.dtype]
    x64 = x.double()
    ref = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    round_bound, acc_bound, walk = (torch.zeros_like(ref) for _ in range(3))
    slots = expert_map.long()[ids.long()]  # [T, K]
    for s in slots.unique().tolist():  # reference only: a loop over the experts in use
        t_idx, k_idx = (slots == s).nonzero(as_tuple=True)
        xs, ws = x64[t_idx], weights[t_idx, k_idx].double()[:, None]
        wg, wu, wd = w13[s, :inter].double(), w13[s, inter:].double(), w2[s].double()
        g, up = xs @ wg.T, xs @ wu.T
        act = F.silu(g) * up
        # how far an f32 error in gate/up moves act (|silu'| <= 1.1)
        act_sens = 1.1 * up.abs() * (xs.abs() @ wg.abs().T) + F.silu(g).abs() * (
            xs.abs() @ wu.abs().T)
        y_abs = act.abs() @ wd.abs().T
        ref.index_add_(0, t_idx, ws * (act @ wd.T))
        round_bound.index_add_(0, t_idx, ws.abs() * u * y_abs)
        if weight_unit:  # gate/up rows move act by act_sens; down rows move y by y_abs
            round_bound.index_add_(0, t_idx, ws.abs() * weight_unit * (
                act_sens @ wd.abs().T + y_abs))
        acc_bound.index_add_(0, t_idx, ws.abs() * (
            (8 + 4 * math.sqrt(inter)) * EPS32 * y_abs
            + 4 * EPS32 * math.sqrt(H) * (act_sens @ wd.abs().T)))
        walk.index_add_(0, t_idx, ws.square() * (act.square() @ wd.square().T))
    round_bound += u * ref.abs()
    return ref, round_bound, acc_bound, walk.sqrt()


def check_experts(out, ref, round_bound, acc_bound, walk):
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.double() - ref).abs()
    bound = round_bound + acc_bound
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"error {err.flatten()[worst]:.3e} above its bound {bound.flatten()[worst]:.3e} "
        f"(ref {ref.flatten()[worst]:.3e}) at {divmod(int(worst), out.shape[1])}")

    def rms(t):
        return t.square().mean().sqrt()

    u = UNIT[out.dtype]
    allowed = 2 * u * (rms(walk) + rms(ref)) + 0.25 * rms(acc_bound)
    assert rms(err) <= allowed, f"RMS error {rms(err):.3e} > {allowed:.3e}"


def make_case(T, E, K, H, inter, dtype, *, slots=None, seed=0, ids=None):
    """Random inputs; expert_map a random injective map into `slots` (>= E) slots."""
    g = torch.Generator(device=_dev()).manual_seed(seed)
    slots = slots or E
    dev = _dev()
    x = torch.randn(T, H, device=dev, generator=g).to(dtype)
    w13 = (torch.randn(slots, 2 * inter, H, device=dev, generator=g) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(slots, H, inter, device=dev, generator=g) / math.sqrt(inter)).to(dtype)
    if ids is None:
        ids = torch.rand(T, E, device=dev, generator=g).argsort(dim=1)[:, :K]
    ids = ids.to(torch.int32).contiguous()
    weights = torch.rand(T, K, device=dev, generator=g) + 0.05
    expert_map = torch.randperm(slots, device=dev, generator=g)[:E].to(torch.int32)
    return x, w13, w2, ids, weights, expert_map


def run_experts(x, w13, w2, ids, weights, expert_map, extra_bytes=0):
    T, K = ids.shape
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    nbytes = ops.moe_workspace_bytes(T, K, expert_map.numel(), w2.shape[2], x.dtype)
    ws = torch.full((nbytes + extra_bytes,), 0xFF, dtype=torch.uint8, device=x.device)
    ops.moe_experts(out, x, w13, w2, ids, weights, expert_map, ws)
    return out


# ---------------------------------------------------------------- moe_experts

@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 7, 32, 300, 2048])
@pytest.mark.parametrize("E,K", [(8, 2), (64, 8), (128, 8)])
def test_experts_qwen3_shape(dtype, T, E, K):
    case = make_case(T, E, K, 2048, 768, dtype, seed=T * 1000 + E)
    out = run_experts(*case)
    check_experts(out, *reference_experts(*case))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,inter", [(100, 40), (96, 36), (64, 17), (8, 8), (136, 200),
                                     (2056, 72)])
@pytest.mark.parametrize("T", [1, 5, 40, 333])
def test_experts_odd_sizes(dtype, H, inter, T):
    case = make_case(T, 6, 2, H, inter, dtype, slots=9, seed=H + inter + T)
    out = run_experts(*case)
    check_experts(out, *reference_experts(*case))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [3, 64, 700])
def test_experts_non_identity_map_and_spare_slots(dtype, T):
    # 16 experts living in 40 slots in a random order, as the offload cache remaps them
    case = make_case(T, 16, 4, 256, 128, dtype, slots=40, seed=7 + T)
    assert not torch.equal(case[5].cpu(), torch.arange(16, dtype=torch.int32))
    out = run_experts(*case)
    check_experts(out, *reference_experts(*case))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(1, 1), (31, 2), (300, 2), (2048, 2), (1500, 8)])
def test_experts_skewed_routing(dtype, T, K):
    # every token picks the same K experts: one segment spans many tiles
    E = 64
    ids = torch.arange(60, 60 - K, -1, device=_dev()).repeat(T, 1)
    case = make_case(T, E, K, 512, 256, dtype, seed=T, ids=ids)
    out = run_experts(*case)
    check_experts(out, *reference_experts(*case))


@gpu
def test_experts_are_deterministic_and_ignore_workspace_contents():
    case = make_case(300, 64, 8, 1024, 384, torch.bfloat16, seed=3)
    first = run_experts(*case)
    second = run_experts(*case, extra_bytes=4096)
    assert torch.equal(first, second)


@gpu
def test_experts_zero_tokens_is_a_no_op():
    case = make_case(0, 8, 2, 64, 32, torch.bfloat16)
    out = run_experts(*case)
    assert out.shape == (0, 64)


# ---------------------------------------------------------------- moe_topk_softmax

def check_routing(weights, ids, logits, K, renormalize):
    """Ids exactly where the reference order is clear (or an exact tie: lower id first);
    within an f32 near-tie the chosen expert's probability must still match its rank."""
    p = torch.softmax(logits.double(), dim=-1)
    p_sorted, order = torch.sort(p, dim=-1, descending=True, stable=True)  # ties: lower id
    top = p_sorted[:, :K]
    want = top / top.sum(-1, keepdim=True) if renormalize else top
    torch.testing.assert_close(weights.double(), want, atol=2e-6, rtol=2e-5)
    ids = ids.long()
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "repeated expert in a row"
    torch.testing.assert_close(p.gather(1, ids), top, atol=1e-6, rtol=1e-5)
    edge = torch.full_like(p_sorted[:, :1], 2.0)
    padded = torch.cat([edge, p_sorted, -edge], dim=1)  # padded[:, k + 1] = p_sorted[:, k]
    above, below = padded[:, :K] - padded[:, 1:K + 1], padded[:, 1:K + 1] - padded[:, 2:K + 2]

    def clear(gap):
        return (gap == 0) | (gap > 1e-5 * top)

    sure = clear(above) & clear(below)
    assert torch.equal(ids[sure], order[:, :K][sure])


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (7, 64, 8), (2048, 128, 8), (33, 60, 4),
                                   (5, 512, 16), (300, 7, 7), (3, 33, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(dtype, T, E, K, renormalize):
    g = torch.Generator(device=_dev()).manual_seed(T + E + K)
    logits = (3 * torch.randn(T, E, device=_dev(), generator=g)).to(dtype)
    weights = torch.full((T, K), float("nan"), device=_dev())
    ids = torch.full((T, K), -7, dtype=torch.int32, device=_dev())
    ops.moe_topk_softmax(weights, ids, logits, renormalize)
    check_routing(weights, ids, logits, K, renormalize)


@gpu
def test_topk_softmax_ties_pick_the_lower_id():
    logits = torch.zeros(4, 16, device=_dev())
    logits[:, 9] = 1.0
    weights = torch.empty(4, 3, device=_dev())
    ids = torch.empty(4, 3, dtype=torch.int32, device=_dev())
    ops.moe_topk_softmax(weights, ids, logits, False)
    assert ids.tolist() == [[9, 0, 1]] * 4


# ---------------------------------------------------------------- graphs and errors

@gpu
@pytest.mark.parametrize("T", [4, 300])
def test_routing_and_experts_replay_in_a_cuda_graph(T):
    E, K, H, inter = 32, 4, 512, 256
    dtype = torch.bfloat16
    x, w13, w2, _, _, emap = make_case(T, E, K, H, inter, dtype, seed=11)
    logits = torch.randn(T, E, device=_dev())
    weights = torch.empty(T, K, device=_dev())
    ids = torch.empty(T, K, dtype=torch.int32, device=_dev())
    out = torch.empty_like(x)
    ws = torch.empty(ops.moe_workspace_bytes(T, K, E, inter, 2), dtype=torch.uint8,
                     device=_dev())

    def step():
        ops.moe_topk_softmax(weights, ids, logits, True)
        ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # load the module outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):  # new inputs in the same buffers, then replay
        g = torch.Generator(device=_dev()).manual_seed(100 + seed)
        logits.copy_(torch.randn(T, E, device=_dev(), generator=g))
        x.copy_(torch.randn(T, H, device=_dev(), generator=g).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_routing(weights, ids, logits, K, True)
        check_experts(out, *reference_experts(x, w13, w2, ids, weights, emap))


@gpu
@pytest.mark.parametrize("T,K,E,inter,dtype", [(4, 2, 8, 32, torch.bfloat16),
                                                (300, 8, 64, 40, torch.float16),
                                                (70, 4, 16, 600, torch.float32)])
def test_workspace_bytes_match_the_kernel_exactly(T, K, E, inter, dtype):
    x, w13, w2, ids, weights, emap = make_case(T, E, K, 64, inter, dtype)
    out = torch.empty_like(x)
    need = ops.moe_workspace_bytes(T, K, E, inter, dtype)
    ws = torch.empty(need, dtype=torch.uint8, device=_dev())
    ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws)
    with pytest.raises(Exception, match=f"workspace must hold at least {need} bytes"):
        ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws[: need - 1])


@gpu
def test_bad_arguments_name_the_argument():
    x, w13, w2, ids, weights, emap = make_case(4, 8, 2, 64, 32, torch.bfloat16)
    out = torch.empty_like(x)
    need = ops.moe_workspace_bytes(4, 2, 8, 32, 2)
    ws = torch.empty(need, dtype=torch.uint8, device=_dev())
    ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws)  # exactly enough is enough
    with pytest.raises(Exception, match="workspace"):
        ops.moe_experts(out, x, w13, w2, ids, weights, emap, ws[: need - 1])
    with pytest.raises(Exception, match="topk_ids"):
        ops.moe_experts(out, x, w13, w2, ids.long(), weights, emap, ws)
    with pytest.raises(Exception, match="w13"):
        ops.moe_experts(out, x, w13[:, :10], w2, ids, weights, emap, ws)
    with pytest.raises(Exception, match="w2"):
        ops.moe_experts(out, x, w13, w2.float(), ids, weights, emap, ws)
    with pytest.raises(Exception, match="expert_map"):
        ops.moe_experts(out, x, w13, w2, ids, weights, emap.cpu(), ws)
    with pytest.raises(Exception, match="top_k"):
        big = torch.zeros(4, 17, dtype=torch.int32, device=_dev())
        ops.moe_experts(out, x, w13, w2, big, big.float(), emap, ws)
    logits = torch.randn(4, 600, device=_dev())
    w, i = torch.empty(4, 2, device=_dev()), torch.empty(4, 2, dtype=torch.int32, device=_dev())
    with pytest.raises(Exception, match="experts must be in 1..512"):
        ops.moe_topk_softmax(w, i, logits, True)
    with pytest.raises(Exception, match="top_k"):
        ops.moe_topk_softmax(w, i, logits[:, :1], True)
    with pytest.raises(Exception, match="topk_weights"):
        ops.moe_topk_softmax(w.half(), i, logits[:, :8], True)


# ---------------------------------------------------------------- no GPU needed

def test_workspace_bytes_arithmetic():
    # decode: tiles of 8 pairs, no f32 chunk; prefill adds [pairs, max(I, 512)] f32
    assert ops.moe_workspace_bytes(1, 8, 128, 768, 2) == 256 + 256 + 8 * 768 * 2
    prefill = ops.moe_workspace_bytes(2048, 8, 128, 768, "bfloat16")
    pairs, tiles = 2048 * 8, 2048 * 8 // 64 + 128
    assert prefill == (-(-12 * tiles // 256) * 256 + 4 * pairs + pairs * 768 * 2
                       + pairs * 768 * 4)
    assert ops.moe_workspace_bytes(5, 2, 8, 32, torch.float32) == ops.moe_workspace_bytes(
        5, 2, 8, 32, 4)
    assert ops.moe_workspace_bytes(0, 8, 128, 768, 2) == 0
    with pytest.raises(ValueError, match="itemsize"):
        ops.moe_workspace_bytes(1, 8, 128, 768, 3)
    with pytest.raises(ValueError, match="itemsize"):
        ops.moe_workspace_bytes(1, 8, 128, 768, "int8")
