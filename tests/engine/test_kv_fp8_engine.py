"""The engine over an FP8 KV pool (--kv-dtype fp8): chunked prefill, scattered pages and
preemption give the tokens of one-shot prefills with room to spare (a token's K/V rows are
quantized alone, with their own scale, however the step that wrote them was cut), and the
memory plan counts the pool at its own bytes."""

import asyncio

import pytest

from freetoken.engine.config import EngineConfig, EngineConfigError, resolve_kv_dtype
from freetoken.engine.engine import Engine
from freetoken.engine.memory_plan import ModelSizes
from freetoken.engine.request import SamplingParams
from freetoken.models.batch import Fp8Pool, KVCache
from tests.engine.test_engine_tiny_llama import NEW_TOKENS, model_dir, prompts  # noqa: F401


def generate(loaded, config, prompts):
    engine = Engine.from_loaded(loaded, config).start()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    async def run(prompt):
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    async def main():
        return await asyncio.gather(*(run(p) for p in prompts))
    try:
        outputs = asyncio.run(main())
        return outputs, engine.stats(), engine
    finally:
        engine.shutdown()


def test_fp8_pool_gives_the_same_tokens_however_steps_are_cut(model_dir, prompts):  # noqa: F811
    from freetoken.models.loader import load_model

    loaded = load_model(str(model_dir), device="cpu")
    roomy = EngineConfig(num_tokens=2048, block_size=16, max_num_seqs=6, max_prefill_tokens=512,
                         device="cpu", kv_dtype="fp8")
    tight = EngineConfig(num_tokens=192, block_size=16, max_num_seqs=6, max_prefill_tokens=16,
                         device="cpu", kv_dtype="fp8")
    want, _, engine = generate(loaded, roomy, prompts)
    assert isinstance(engine.kv.k[0], Fp8Pool) and engine.stats()["kv_dtype"] == "fp8"
    got, stats, _ = generate(loaded, tight, prompts)
    assert got == want and stats["preemptions"] > 0


def test_fp8_pool_bytes():
    """Per token and layer: K and V at one byte an element plus a float32 scale per head."""
    from freetoken.models.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                      num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=1e4, max_position=256)
    want = 2 * 3 * (2 * 16 + 2 * 4)
    assert KVCache.bytes_per_token(cfg, "fp8") == want
    assert ModelSizes.of(cfg, "float32", "fp8").kv_bytes_per_token == want
    assert KVCache.bytes_per_token(cfg, "bfloat16") == 2 * 3 * 2 * 16 * 2


def test_fp8_is_a_kv_dtype_on_either_device():
    assert resolve_kv_dtype("fp8", True, "float32") == "fp8"
    assert resolve_kv_dtype("fp8", False, "bfloat16") == "fp8"
    with pytest.raises(EngineConfigError, match="--dtype bfloat16"):
        resolve_kv_dtype("fp8", False, "float32")   # the GPU kernels take 16-bit queries
    with pytest.raises(EngineConfigError, match="kv_dtype"):
        EngineConfig(kv_dtype="fp4")


def test_fp8_pool_copies_codes_and_scales_together():
    """Live resize copies pools slot range by slot range: an FP8 pool's scales go with its
    codes, and its byte count is both arrays'."""
    import numpy as np

    old = Fp8Pool(np.arange(4 * 2 * 8, dtype=np.uint8).reshape(4, 2, 8),
                  np.arange(8, dtype=np.float32).reshape(4, 2))
    new = Fp8Pool(np.zeros((6, 2, 8), np.uint8), np.ones((6, 2), np.float32))
    new[:3] = old[:3]
    assert (new.codes[:3] == old.codes[:3]).all() and (new.scales[:3] == old.scales[:3]).all()
    assert (new.codes[3:] == 0).all() and (new.scales[3:] == 1).all()
    assert new.shape == (6, 2, 8) and new.nbytes == 6 * 2 * 8 + 6 * 2 * 4
