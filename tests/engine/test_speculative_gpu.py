"""Speculative decoding on a GPU (verify steps in CUDA graphs, one per K, and eagerly): drafts
that are plain decoding's own tokens are accepted (the verify rows line up with their
positions, padded or not), a hybrid model's states roll back, an MTP block drafts from a
replayed graph's hidden states, and every page and slot is freed. Skipped without a GPU.

Token-for-token equality with plain decoding is not asserted here: on a GPU the multi-token
kernels of a verify step round differently from the decode kernels (docs/speculative-decoding.md)."""

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.models.loader import load_model
from tests.engine.test_speculative_hybrid import generate
from tests.models.test_hybrid_hf import build_hybrid
from tests.models.test_mtp import add_mtp, mtp_tensors

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOKENS = 24
# the GPU kernels take head dims of 64, 128 or 256
GPU_SHAPE = dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)


def engines(loaded, speculative, k=3, cuda_graphs=True):
    return Engine.from_loaded(loaded, EngineConfig(
        num_tokens=1024, block_size=16, max_num_seqs=4, max_prefill_tokens=64, device="cuda",
        speculative=speculative, num_speculative_tokens=k, cuda_graphs=cuda_graphs)).start()


def plain_outputs(loaded, lengths, seed):
    """Random prompts of these lengths and plain decoding's greedy tokens for them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in lengths]
    plain = engines(loaded, "off")
    try:
        return prompts, generate(plain, prompts, max_tokens=TOKENS)
    finally:
        plain.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_oracle_drafts_are_accepted_on_the_gpu(arch, tmp_path):
    from tests.models.helpers import tiny_hf_model

    if arch == "llama":
        tiny_hf_model("llama", tmp_path, seed=3, head_dim=64)
    else:
        build_hybrid(arch, tmp_path, **GPU_SHAPE)
    # float32: a random model's near-ties would let bf16 rounding steer the two runs apart
    loaded = load_model(str(tmp_path), device="cuda", dtype="float32")
    prompts, expected = plain_outputs(loaded, (7, 30), seed=5)
    for graphs in (True, False):
        spec = engines(loaded, "ngram", cuda_graphs=graphs)
        try:
            got = generate(spec, prompts, oracle=expected, max_tokens=TOKENS)
            stats = spec.stats()
            replays = spec.graphs.verify_replays if graphs else 0
        finally:
            spec.shutdown()
        assert [len(g) for g in got] == [TOKENS] * len(prompts)
        # the oracle spoils one draft token in three steps: the rest are plain decoding's
        # tokens, so the output is too
        assert stats["spec_acceptance_rate"] > 0.6, stats
        assert got == expected
        assert stats["kv_pages_used"] == 0 and stats.get("state_slots_used", 0) == 0
        if graphs:   # verify steps replayed their graph (the last ones draft fewer: padded)
            assert replays > 0


def test_mtp_drafts_on_the_gpu(tmp_path):
    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=2, **GPU_SHAPE)
    add_mtp(tmp_path, mtp_tensors(hf.config, "fused"))
    loaded = load_model(str(tmp_path), device="cuda")
    assert loaded.model.mtp is not None
    for graphs in (True, False):
        spec = engines(loaded, "mtp", k=2, cuda_graphs=graphs)
        try:
            got = generate(spec, [[5, 9, 11, 4, 7, 3]] * 2, max_tokens=TOKENS)
            stats = spec.stats()
            if graphs:   # the block drafted from a replayed graph's hidden states, its own
                # steps replayed from their graphs
                assert spec.graphs.verify_replays > 0 and spec.mtp.graphs.replays > 0
        finally:
            spec.shutdown()
        assert [len(g) for g in got] == [TOKENS] * 2
        assert stats["speculative"] == "mtp" and stats["spec_draft_tokens"] > 0
        assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0


def test_mtp_graph_steps_match_eager_steps(tmp_path):
    """Every MTP block step replayed from a graph (engine/mtp_graphs.py) drafts the tokens the
    eager step drafts from the same hidden rows, and stores the same K/V in the block's pool."""
    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=2, **GPU_SHAPE)
    add_mtp(tmp_path, mtp_tensors(hf.config, "fused"))
    loaded = load_model(str(tmp_path), device="cuda", dtype="float32")
    spec = engines(loaded, "mtp", k=3)
    mtp, checked = spec.mtp, []
    graph_step = mtp._graph_step

    def compare(parts, pool, drafting):
        pools = mtp.kv.k + mtp.kv.v
        before = [t.clone() for t in pools]
        hidden = mtp.graphs.hidden_rows(parts).clone()
        left = graph_step(parts, pool, drafting)
        assert left is None
        drafts = [r.draft_state.mtp_draft for r in drafting]
        after = [t.clone() for t in pools]
        for t, saved in zip(pools, before):
            t.copy_(saved)
        mtp.step(parts, hidden, pool, drafting)           # eager: the hidden rows as a copy
        assert [r.draft_state.mtp_draft for r in drafting] == drafts
        for t, graph_t in zip(pools, after):
            torch.testing.assert_close(graph_t, t, rtol=0, atol=1e-4 * t.abs().max())
        checked.append((len(parts), [len(d) for d in drafts]))

    mtp._graph_step = compare
    for t in mtp.kv.k + mtp.kv.v:   # no stale bits (NaN) in slots neither step writes
        t.zero_()
    try:
        generate(spec, [[5, 9, 11, 4, 7, 3], [8, 2, 6, 1, 9, 9, 4, 2, 7]], max_tokens=TOKENS)
    finally:
        spec.shutdown()
    assert checked and any(3 in d for _, d in checked), checked


def test_verify_graphs_match_eager_forwards(tmp_path):
    """Every verify step replayed from a graph (padded where a sequence drafted fewer than K)
    gives the logits and hidden rows an eager forward of the same batch gives."""
    from tests.models.helpers import tiny_hf_model

    tiny_hf_model("llama", tmp_path, seed=4, head_dim=64)
    loaded = load_model(str(tmp_path), device="cuda", dtype="float32")
    prompts, expected = plain_outputs(loaded, (9, 40, 3), seed=6)
    spec = engines(loaded, "ngram", k=3)
    graphs, model, checked = spec.graphs, spec.model, []
    replay = graphs.run_verify

    def run_verify(draft_lengths, batch):
        logits = replay(draft_lengths, batch).clone()
        hidden = model.last_hidden.clone()
        eager = model.forward(batch, spec.kv)   # stores the same K/V again: no change
        scale = eager.abs().max()
        torch.testing.assert_close(logits, eager, rtol=0, atol=1e-4 * scale)
        torch.testing.assert_close(hidden, model.last_hidden, rtol=0,
                                   atol=1e-4 * model.last_hidden.abs().max())
        checked.append(tuple(draft_lengths))
        return logits

    graphs.run_verify = run_verify
    try:
        generate(spec, prompts, oracle=expected, max_tokens=TOKENS)
    finally:
        spec.shutdown()
    # padded steps among them: three sequences replay the graph of four, or fewer drafts
    assert checked and any(len(d) not in graphs.verify_sizes or min(d) < 3
                           for d in checked), checked


def test_speculation_with_offloaded_experts(tmp_path):
    """--speculative ngram with experts in host memory: verify steps go through the expert
    cache (eagerly) and give plain resident decoding's tokens."""
    from freetoken.engine.offload_setup import OffloadDecision
    from tests.models.helpers import tiny_hf_model

    tiny_hf_model("qwen3_moe", tmp_path, seed=7, head_dim=64)
    resident = load_model(str(tmp_path), device="cuda", dtype="float32")
    prompts, expected = plain_outputs(resident, (6, 21), seed=8)
    del resident
    offloaded = load_model(str(tmp_path), device="cuda", dtype="float32",
                           plan=lambda cfg, dtype, weights: True)
    spec = Engine.from_loaded(offloaded, EngineConfig(
        num_tokens=1024, block_size=16, max_num_seqs=4, max_prefill_tokens=64, device="cuda",
        speculative="ngram", num_speculative_tokens=3),
        offload=OffloadDecision(0.5, 1024, None, None, False)).start()
    try:
        assert spec.expert_cache is not None and spec.drafter is not None
        got = generate(spec, prompts, oracle=expected, max_tokens=TOKENS)
        stats = spec.stats()
    finally:
        spec.shutdown()
    assert got == expected
    assert stats["spec_acceptance_rate"] > 0.6, stats
    assert stats["kv_pages_used"] == 0
