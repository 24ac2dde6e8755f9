"""benchmarks/gpu_speculative.py's ceiling arithmetic (no GPU needed): the expected count of
distinct experts against sampled uniform routing, and a plain step's bytes against
benchmarks/gpu_hybrid.py's own batch-1 formula."""

import argparse

import numpy as np
import pytest

from benchmarks.gpu_hybrid import QWEN36_35B_A3B, bytes_per_token
from benchmarks.gpu_speculative import distinct_experts, step_bytes

CFG = argparse.Namespace(**QWEN36_35B_A3B,
                         layer_types=["linear_attention"] * 3 + ["full_attention"])


@pytest.mark.parametrize("tokens", [1, 3, 24])
def test_distinct_experts_matches_sampled_uniform_routing(tokens):
    rng = np.random.default_rng(0)
    e, k = CFG.num_experts, CFG.num_experts_per_tok
    counts = [len({x for _ in range(tokens) for x in rng.choice(e, k, replace=False)})
              for _ in range(4000)]
    # 4000 draws: the sample mean's standard error is below 0.1 experts here
    assert abs(np.mean(counts) - distinct_experts(tokens, CFG)) < 0.4


def test_a_plain_step_moves_what_the_hybrid_benchmark_counts():
    moved, emitted = step_bytes(CFG, batch=1, k=0, context=256)
    assert emitted == 1
    assert moved == bytes_per_token(CFG, 256)


def test_drafting_adds_the_blocks_steps_and_more_experts():
    plain, _ = step_bytes(CFG, 1, 0, 256)
    moved, emitted = step_bytes(CFG, 1, 2, 256)
    assert emitted == 3
    head = CFG.vocab_size * CFG.hidden_size * 2
    assert moved > plain + 2 * head     # two block steps, each reading the LM head


@pytest.mark.parametrize("flags", [["--k", "2,x"], ["--k", "5"], ["--moe-cache-rate", "0"],
                                   ["--batch-sizes", "0"], ["--layers", "6"],
                                   ["--modes", "agree,fast"]])
def test_bad_arguments_exit_naming_the_flag(flags, monkeypatch, capsys):
    import sys

    from benchmarks import gpu_speculative

    monkeypatch.setattr(sys, "argv", ["gpu_speculative.py", *flags])
    with pytest.raises(SystemExit) as exc:
        gpu_speculative.main()     # refused before any GPU work
    assert flags[0] in str(exc.value)
