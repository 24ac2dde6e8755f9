"""The FP8 KV pool (--kv-dtype fp8) through the dense forward, against transformers' float32
forward of the same weights: logits within one e4m3 rounding of K and V per layer, and
measurably off the float pool's (the pool really is FP8)."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.batch import Fp8Pool
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.models.test_dense_hf import hf_last_logits, prompts


def max_logit_error(model, hf, kv_dtype: str | None) -> float:
    """Two sequences: a chunked prefill beside a whole one, then 6 decode steps of both; every
    step's logits checked against transformers; the largest difference seen."""
    runner = PagedRunner(model, kv_dtype=kv_dtype)
    a, b = prompts(model.config.vocab_size)
    worst = 0.0

    def check(logits, seq):
        nonlocal worst
        expected = hf_last_logits(hf, seq)
        assert_logits_close(logits, expected, model.config, kv_dtype)
        worst = max(worst, float((logits.float() - expected).abs().max()))

    logits = runner.step([(0, a[:10]), (1, b)])          # a: first chunk; b: whole prompt
    check(logits[1], b)
    b.append(int(logits[1].argmax()))
    logits = runner.step([(0, a[10:]), (1, b[-1:])])      # a: second chunk; b: decode
    for _ in range(6):
        check(logits[0], a)
        check(logits[1], b)
        a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
        logits = runner.step([(0, a[-1:]), (1, b[-1:])])
    if kv_dtype == "fp8":
        assert isinstance(runner.kv.k[0], Fp8Pool)
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_kv_logits_close_to_transformers(arch, tiny_checkpoint):
    directory, hf = tiny_checkpoint(arch)
    model = load_model(str(directory), device="cpu").model
    fp8 = max_logit_error(model, hf, "fp8")
    exact = max_logit_error(model, hf, None)
    assert fp8 > 100 * exact, (fp8, exact)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_fp8_kv_logits_close_to_the_bf16_pool(arch, tmp_path):
    """On the GPU (bf16 model): eager prefill chunks, then decode steps, which take the fused
    decode layers (rope_store_kv_fp8); the FP8 pool's logits within one e4m3 rounding of K and
    V per layer of the bf16 pool's, and not equal to them. Heads of 64: the smallest the GPU
    attention kernels take."""
    from tests.models.helpers import tiny_hf_model

    tiny_hf_model(arch, tmp_path, hidden_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)
    model = load_model(str(tmp_path), device="cuda", dtype="bfloat16").model
    assert model.config.head_dim == 64
    runs = {}
    for kv_dtype in ("bfloat16", "fp8"):
        runner = PagedRunner(model, kv_dtype=kv_dtype)
        a, b = prompts(model.config.vocab_size)
        steps = [runner.step([(0, a[:10]), (1, b)]).float().cpu().clone()]
        steps.append(runner.step([(0, a[10:]), (1, [5])]).float().cpu().clone())
        for token in range(6):
            steps.append(runner.step([(0, [token]), (1, [token + 1])]).float().cpu().clone())
        runs[kv_dtype] = torch.stack(steps)
    from tests.tolerances import assert_close
    assert_close(runs["fp8"], runs["bfloat16"], torch.float32, compute="float8_e4m3fn",
                 terms=model.config.num_layers, ulps=2)
    assert not torch.equal(runs["fp8"], runs["bfloat16"])
