"""The fused GPU decode step (steps of up to 4 tokens) against transformers' float32 forward,
beside the unfused step of the same bf16 weights: batched decode of sequences at different
lengths and a short multi-token chunk, on a per-head q/k norm model (qwen3), one with a qkv bias
(qwen2), a MoE (qwen3_moe: fused attention, routed MLP) and a hybrid (qwen3_5_moe: Gated
DeltaNet and gated attention layers). The fused step must be about as
close to float32 as the unfused one is. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=3,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64,
             rope_theta=1000000.0, max_position_embeddings=4096, rms_norm_eps=1e-6)


# qwen3_5_moe: three Gated DeltaNet layers and one gated attention layer, routed experts
HYBRID = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
              linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
              num_experts=64, num_experts_per_tok=4, moe_intermediate_size=256,
              shared_expert_intermediate_size=256, max_position_embeddings=4096,
              rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention",
                                              "linear_attention", "linear_attention"])


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(folder, fused: bool, monkeypatch, prompts, steps):
    """Logits of every step: one prefill per prompt, then `steps` (lists of (seq, tokens))."""
    from freetoken.models.loader import load_model

    monkeypatch.setenv("FREETOKEN_FUSED_DECODE", "1" if fused else "0")
    model = load_model(str(folder), device="cuda").model
    assert (model._fused is not None) == fused
    runner = PagedRunner(model, num_blocks=64, block_size=16)
    for seq, prompt in enumerate(prompts):
        runner.step([(seq, prompt)])
    out = [runner.step(chunks).clone() for chunks in steps]
    del model, runner
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe", "qwen3_5_moe"])
def test_fused_decode_matches_unfused_accuracy(arch, tmp_path, monkeypatch, moe_ops):
    if arch == "qwen3_5_moe":
        from tests.models.test_hybrid_hf import build_hybrid

        hf = build_hybrid(arch, tmp_path, seed=5, **HYBRID).to("cuda")
    else:
        extra = dict(moe_intermediate_size=256) if arch == "qwen3_moe" else {}
        hf = tiny_hf_model(arch, tmp_path, seed=5, **SHAPE, **extra).to("cuda")
    gen = torch.Generator().manual_seed(3)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (37, 5, 80)]
    seqs = [list(p) for p in prompts]
    steps = []

    def one(seq):
        return (seq, [int(torch.randint(0, vocab, (1,), generator=gen))])

    # T = 3 (norms as kernels), 2 and 1 (norms in the GEMV prologues), a 4-token chunk (fused)
    # and a 6-token one (wider than the fused path: cuBLAS)
    for seqs_in_step in ([0, 1, 2], [0, 1, 2], [2, 0], [1], "chunk4", "chunk6"):
        if isinstance(seqs_in_step, str):
            n = int(seqs_in_step[-1])
            chunks = [(0, torch.randint(0, vocab, (n,), generator=gen).tolist())]
        else:
            chunks = [one(s) for s in seqs_in_step]
        steps.append(chunks)
    fused = _run(tmp_path, True, monkeypatch, prompts, steps)
    plain = _run(tmp_path, False, monkeypatch, prompts, steps)
    errors = []
    for chunks, ours, theirs in zip(steps, fused, plain):
        for row, (seq, tokens) in enumerate(chunks):
            seqs[seq] += tokens
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[seq]], device="cuda")).logits[0, -1]
            err_fused, err_plain = _rel(ours[row], ref), _rel(theirs[row], ref)
            errors.append((err_fused, err_plain))
            # a bf16 rounding can flip a near-tied expert choice in a MoE and move one row's
            # logits by O(1) in either path: there only the means over every row are compared
            if not arch.endswith("moe"):
                assert err_fused < 0.25, (arch, chunks, row, err_fused)  # a bug is O(1)
                assert err_fused < max(2 * err_plain, 2 * EPS["bfloat16"]), (
                    arch, chunks, row, err_fused, err_plain)
    mean_fused = sum(e for e, _ in errors) / len(errors)
    mean_plain = sum(e for _, e in errors) / len(errors)
    assert mean_fused < max(2 * mean_plain, 2 * EPS["bfloat16"]), (arch, errors)
