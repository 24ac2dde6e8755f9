"""The dense forward against HF transformers on the same tiny random checkpoints.

Each model runs a mixed batch the way the engine drives it: a chunked prefill of one
sequence beside the full prefill of another, then decode steps for both, over scattered KV
pages of 16 slots. Every step's logits must match transformers' full-sequence forward on the
same tokens within float32 rounding (tests/tolerances.py), and the greedy token must be the same.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.tolerances import bound
DECODE_STEPS = 8


def hf_last_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def prompts(vocab: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, vocab, (21,), generator=gen).tolist()
    b = torch.randint(0, vocab, (13,), generator=gen).tolist()
    return a, b


def run_and_compare(model, hf, kv_dtype: str | None = None) -> list[int]:
    """Drive two sequences through prefill + decode; return sequence a's greedy tokens."""
    runner = PagedRunner(model, kv_dtype=kv_dtype)
    a, b = prompts(model.config.vocab_size)
    full_a = list(a)
    logits = runner.step([(0, a[:10]), (1, b)])          # a: first chunk; b: whole prompt
    assert_logits_close(logits[1], hf_last_logits(hf, b), model.config, kv_dtype)
    b.append(int(logits[1].argmax()))
    logits = runner.step([(0, a[10:]), (1, b[-1:])])      # a: second chunk; b: decode
    generated = []
    for _ in range(DECODE_STEPS):
        for row, seq in ((0, full_a), (1, b)):
            expected = hf_last_logits(hf, seq)
            assert_logits_close(logits[row], expected, model.config, kv_dtype)
            assert int(logits[row].argmax()) == int(expected.argmax())
        full_a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
        generated.append(full_a[-1])
        logits = runner.step([(0, full_a[-1:]), (1, b[-1:])])
    return generated


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_forward_matches_transformers(arch, tiny_checkpoint):
    directory, hf = tiny_checkpoint(arch)
    loaded = load_model(str(directory), device="cpu")
    assert loaded.config.architecture == arch
    assert loaded.model.dtype == "float32"
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.qk_norm == ("head" if arch == "qwen3" else None)
    run_and_compare(loaded.model, hf)


def test_mistral_window_is_applied(tiny_checkpoint):
    """The sliding window (8) is shorter than the sequences, so it changes the logits."""
    directory, hf = tiny_checkpoint("mistral")
    loaded = load_model(str(directory))
    assert loaded.config.sliding_window == 8
    a, _ = prompts(loaded.config.vocab_size)
    windowed = hf_last_logits(hf, a)
    hf.config.sliding_window = None
    try:
        full = hf_last_logits(hf, a)
    finally:
        hf.config.sliding_window = 8
    cfg = loaded.config  # the window moves the logits far beyond float32 rounding
    rounding = bound(torch.float32, windowed.abs().max(),
                     (cfg.hidden_size + cfg.intermediate_size) * cfg.num_layers)
    assert (windowed - full).abs().max() > 100 * rounding
    runner = PagedRunner(loaded.model)
    assert_logits_close(runner.step([(0, a)])[0], windowed, loaded.config)


def test_tied_embeddings(tmp_path):
    """With tie_word_embeddings the LM head reads the embedding table."""
    from tests.models.helpers import tiny_hf_model

    hf = tiny_hf_model("llama", tmp_path, seed=3, tie_word_embeddings=True)
    loaded = load_model(str(tmp_path))
    assert loaded.config.tie_word_embeddings
    runner = PagedRunner(loaded.model)
    a, _ = prompts(loaded.config.vocab_size)
    assert_logits_close(runner.step([(0, a)])[0], hf_last_logits(hf, a), loaded.config)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float16_kv_pool_stays_close_to_transformers(arch, tiny_checkpoint):
    """The CPU's default KV pool holds float16 (activations stay float32): every step's logits
    within float16 rounding of transformers' float32 forward, greedy tokens equal."""
    directory, hf = tiny_checkpoint(arch)
    loaded = load_model(str(directory), device="cpu")
    run_and_compare(loaded.model, hf, kv_dtype="float16")
