"""The MoE references (kernel/reference.py) against a plain float64 loop over tokens and their
experts: they are the contract the compiled MoE kernels are tested against, numpy and torch
alike. Tolerances: float32 accumulation over H and I terms of magnitude ~1 (1e-5 relative)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops, reference


def naive_topk(logits: np.ndarray, k: int, renormalize: bool):
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.array([sorted(range(len(row)), key=lambda e: (-row[e], e))[:k] for row in probs])
    weights = np.take_along_axis(probs, ids, -1)
    if renormalize:
        weights /= weights.sum(-1, keepdims=True)
    return weights, ids


def naive_experts(x, w13, w2, ids, weights, expert_map) -> np.ndarray:
    out = np.zeros((x.shape[0], w2.shape[1]))
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            s = expert_map[ids[t, k]]
            h = w13[s].astype(np.float64) @ x[t].astype(np.float64)
            act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
            out[t] += weights[t, k] * (w2[s].astype(np.float64) @ act)
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_topk_softmax_orders_ties_by_expert_id(renormalize, backend):
    gen = np.random.default_rng(0)
    logits = gen.standard_normal((9, 16)).astype(np.float32)
    logits[0, [3, 7, 11]] = 5.0                  # a three-way tie: ids 3, 7, 11 in that order
    logits[1] = 0.0                              # all equal: 0, 1, 2, 3
    weights, ids = np.empty((9, 4), np.float32), np.empty((9, 4), np.int32)
    if backend == "torch":
        tw, ti = torch.from_numpy(weights), torch.from_numpy(ids)
        reference.moe_topk_softmax(tw, ti, torch.from_numpy(logits), renormalize)
    else:
        reference.moe_topk_softmax(weights, ids, logits, renormalize)
    want_w, want_ids = naive_topk(logits.astype(np.float64), 4, renormalize)
    assert ids[0, :3].tolist() == [3, 7, 11] and ids[1].tolist() == [0, 1, 2, 3]
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_experts_follow_the_expert_map(backend):
    gen = np.random.default_rng(1)
    t, h, inter, experts, slots, k = 7, 32, 16, 6, 9, 3
    x = gen.standard_normal((t, h)).astype(np.float32)
    w13 = (gen.standard_normal((slots, 2 * inter, h)) / np.sqrt(h)).astype(np.float32)
    w2 = (gen.standard_normal((slots, h, inter)) / np.sqrt(inter)).astype(np.float32)
    ids = np.stack([gen.permutation(experts)[:k] for _ in range(t)]).astype(np.int32)
    weights = gen.random((t, k)).astype(np.float32)
    expert_map = gen.permutation(slots)[:experts].astype(np.int32)   # not the identity
    out = np.full((t, h), np.nan, np.float32)
    workspace = np.empty(ops.moe_workspace_bytes(t, k, experts, inter, "float32"), np.uint8)
    args = (x, w13, w2, ids, weights, expert_map, workspace)
    if backend == "torch":
        out_t = torch.from_numpy(out)
        reference.moe_experts(out_t, *(torch.from_numpy(a) for a in args))
    else:
        reference.moe_experts(out, *args)
    want = naive_experts(x, w13, w2, ids, weights, expert_map)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [ops.Q8_0, ops.Q4_0, ops.Q4_1, 1, 0])
def test_quantized_experts_compute_on_the_dequantized_rows(qtype):
    """GGUF blocks made and read back by the `gguf` package (independent of reference.py)."""
    from gguf import GGMLQuantizationType, quants

    gen = np.random.default_rng(2)
    t, h, inter, experts, k = 5, 64, 32, 4, 2
    kind = GGMLQuantizationType(qtype)
    w13 = gen.standard_normal((experts, 2 * inter, h)).astype(np.float32) / 8
    w2 = gen.standard_normal((experts, h, inter)).astype(np.float32) / 6

    def blocks(w):
        if qtype in (0, 1):
            data = w.astype(np.float32 if qtype == 0 else np.float16)
            return data.view(np.uint8), data.astype(np.float32)
        q = quants.quantize(w, kind)
        return q, quants.dequantize(q, kind)

    (q13, d13), (q2, d2) = blocks(w13), blocks(w2)
    x = gen.standard_normal((t, h)).astype(np.float32)
    ids = np.stack([gen.permutation(experts)[:k] for _ in range(t)]).astype(np.int32)
    weights = gen.random((t, k)).astype(np.float32)
    emap = np.arange(experts, dtype=np.int32)
    out = np.empty((t, h), np.float32)
    reference.moe_experts_quant(out, x, q13, q2, qtype, qtype, ids, weights, emap,
                                np.empty(0, np.uint8))
    want = naive_experts(x, d13, d2, ids, weights, emap)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_workspace_grows_with_tokens_and_dtype():
    small = ops.moe_workspace_bytes(1, 8, 128, 768, "bfloat16")
    assert small % 256 == 0 and small >= 4 * (8 + 129)
    assert ops.moe_workspace_bytes(64, 8, 128, 768, "bfloat16") > small
    assert ops.moe_workspace_bytes(1, 8, 128, 768, 4) > small
