"""Speculative decoding on a GPU (eager verify steps beside decode CUDA graphs): drafts that
are plain decoding's own tokens are accepted (the verify rows line up with their positions),
a hybrid model's states roll back, an MTP block drafts, and every page and slot is freed.
Skipped without a GPU.

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


def engines(loaded, speculative, k=3):
    return Engine.from_loaded(loaded, EngineConfig(
        num_tokens=1024, block_size=16, max_num_seqs=4, max_prefill_tokens=64, device="cuda",
        speculative=speculative, num_speculative_tokens=k)).start()


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_moe"])
def test_oracle_drafts_are_accepted_on_the_gpu(arch, tmp_path):
    from tests.models.helpers import tiny_hf_model

    if arch == "llama":
        tiny_hf_model("llama", tmp_path, seed=3, head_dim=64)
    else:
        build_hybrid(arch, tmp_path, **GPU_SHAPE)
    # float32: a random model's near-ties would let bf16 rounding steer the two runs apart
    loaded = load_model(str(tmp_path), device="cuda", dtype="float32")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (7, 30)]
    plain = engines(loaded, "off")
    try:
        expected = generate(plain, prompts, max_tokens=TOKENS)
    finally:
        plain.shutdown()
    spec = engines(loaded, "ngram")
    try:
        got = generate(spec, prompts, oracle=expected, max_tokens=TOKENS)
        stats = spec.stats()
    finally:
        spec.shutdown()
    assert [len(g) for g in got] == [TOKENS] * len(prompts)
    # the oracle spoils one draft token in three steps: the rest are plain decoding's tokens
    assert stats["spec_acceptance_rate"] > 0.6, stats
    assert stats["kv_pages_used"] == 0 and stats.get("state_slots_used", 0) == 0


def test_mtp_drafts_on_the_gpu(tmp_path):
    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=2, **GPU_SHAPE)
    add_mtp(tmp_path, mtp_tensors(hf.config, "fused"))
    loaded = load_model(str(tmp_path), device="cuda")
    assert loaded.model.mtp is not None
    spec = engines(loaded, "mtp", k=2)
    try:
        got = generate(spec, [[5, 9, 11, 4, 7, 3]] * 2, max_tokens=TOKENS)
        stats = spec.stats()
    finally:
        spec.shutdown()
    assert [len(g) for g in got] == [TOKENS] * 2
    assert stats["speculative"] == "mtp" and stats["spec_draft_tokens"] > 0
    assert stats["kv_pages_used"] == 0 and stats["state_slots_used"] == 0
