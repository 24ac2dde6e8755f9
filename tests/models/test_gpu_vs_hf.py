"""GPU forward against HF transformers on random weights of real model shapes (reduced depth),
dense and MoE (real expert counts and widths; the MoE ops are the registry's kernels, or the
torch references where this build has none).

Our bf16 forward must be about as close to HF's float32 result as HF's own bf16 forward is; greedy
tokens must agree wherever HF's float32 top-2 margin exceeds twice HF's own bf16 error. Skipped without a CUDA GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPES = {
    # SmolLM2-135M's real config (all 30 layers).
    "smollm2": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                              rope_theta=100000.0, max_position_embeddings=8192,
                              tie_word_embeddings=True, rms_norm_eps=1e-5)),
    # Qwen3-0.6B's shapes at 4 of 28 layers.
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 rope_theta=1000000.0, max_position_embeddings=40960,
                                 tie_word_embeddings=True, rms_norm_eps=1e-6)),
    # Mistral-7B's shapes at 2 of 32 layers, with a sliding window shorter than the test.
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                                   max_position_embeddings=32768, sliding_window=48,
                                   rms_norm_eps=1e-5)),
    # Qwen3-30B-A3B's shapes at 2 of 48 layers: 128 experts, 8 per token.
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144,
                                        moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, norm_topk_prob=True,
                                        num_hidden_layers=2, num_attention_heads=32,
                                        num_key_value_heads=4, head_dim=128,
                                        rope_theta=1000000.0, max_position_embeddings=40960,
                                        rms_norm_eps=1e-6)),
    # Qwen1.5-MoE-A2.7B's shapes at 2 of 24 layers: 60 experts, 4 per token, a shared expert.
    "qwen1.5-moe-a2.7b": ("qwen2_moe", dict(hidden_size=2048, intermediate_size=5632,
                                            moe_intermediate_size=1408, num_experts=60,
                                            num_experts_per_tok=4,
                                            shared_expert_intermediate_size=5632,
                                            num_hidden_layers=2, num_attention_heads=16,
                                            num_key_value_heads=16, head_dim=128,
                                            rope_theta=1000000.0, rms_norm_eps=1e-6,
                                            max_position_embeddings=8192)),
    # Mixtral-8x7B's shapes at 1 of 32 layers: 8 experts, 2 per token.
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336,
                                     num_local_experts=8, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                                     max_position_embeddings=32768, rms_norm_eps=1e-5)),
    # OLMoE-1B-7B's shapes at 2 of 16 layers: 64 experts, 8 per token, q/k norms.
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                                  num_experts_per_tok=8, num_hidden_layers=2,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  head_dim=128, rope_theta=10000.0, max_position_embeddings=4096,
                                  rms_norm_eps=1e-5)),
    # Gemma-3-1B's shapes at 6 of 26 layers (five sliding, one global), a window shorter than
    # the test, both rope bases, q/k norms, the four norms per layer and GELU-tanh.
    "gemma3-1b": ("gemma3", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=6,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                 query_pre_attn_scalar=256, sliding_window=48,
                                 max_position_embeddings=32768, tie_word_embeddings=True,
                                 rms_norm_eps=1e-6,
                                 rope_parameters={
                                     "full_attention": {"rope_type": "default",
                                                        "rope_theta": 1000000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 10000.0}})),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", list(SHAPES))
def test_gpu_logits_match_transformers(name, tmp_path, moe_ops):
    from freetoken.models.loader import load_model

    arch, shape = SHAPES[name]
    hf = tiny_hf_model(arch, tmp_path, seed=3, **shape)
    hf32 = hf.to("cuda")
    hf16 = type(hf)(hf.config).to("cuda", torch.bfloat16).eval()
    hf16.load_state_dict(hf32.state_dict())
    loaded = load_model(str(tmp_path), device="cuda")
    assert loaded.model.dtype == "bfloat16"
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16)

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (70,), generator=gen).tolist()
    tokens, ours = list(prompt), [runner.step([(0, prompt)])[0]]
    moe = getattr(hf.config, "num_experts", None) or getattr(hf.config, "num_local_experts", None)
    errors = []
    for _ in range(10):                      # decode greedily from HF float32's choices
        with torch.no_grad():
            ref = hf32(torch.tensor([tokens], device="cuda")).logits[0, -1]
        nxt = int(ref.argmax())
        with torch.no_grad():
            ref16 = hf16(torch.tensor([tokens], device="cuda")).logits[0, -1]
        # A margin is clear when it exceeds twice HF's own bf16 deviation from float32.
        top2, noise = ref.topk(2).values, (ref16.float() - ref).abs().max()
        clear = ((top2[0] - top2[1]) > 2 * noise).item()
        err_ours, err_hf16 = _rel(ours[-1], ref), _rel(ref16, ref)
        errors.append((err_ours, err_hf16))
        # within twice HF's own bf16 error, or two bf16 ulps of the logits' scale. In an MoE a
        # bf16 rounding can flip a near-tied expert choice, which moves the logits by O(1): which
        # steps flip differs between any two bf16 implementations, so there the bound holds for
        # the mean over the steps, not for each step.
        assert moe or err_ours < max(2.0 * err_hf16, 2 * EPS["bfloat16"]), (
            name, len(tokens), err_ours, err_hf16)
        if clear:
            assert int(ours[-1].argmax()) == nxt, (name, len(tokens), top2.tolist(),
                                                   noise.item(), ours[-1].topk(2))
        tokens.append(nxt)
        ours.append(runner.step([(0, [nxt])])[0])
    ours_mean = sum(e for e, _ in errors) / len(errors)
    hf16_mean = sum(e for _, e in errors) / len(errors)
    assert ours_mean < max(2.0 * hf16_mean, 2 * EPS["bfloat16"]), (name, errors)


@pytest.mark.parametrize("moe_decode", ["0", "1"])
def test_moe_decode_in_cuda_graphs_gives_the_eager_tokens(tmp_path, moe_ops, moe_decode,
                                                         monkeypatch):
    """The engine's decode graphs (routing, expert sort and workspace captured at a fixed
    batch size) pick the same greedy tokens as eager steps of the same model. The eager steps
    pass block tables as wide as the graphs' (zero-padded): a decode step's attention splits
    its KV range by the table width, so at any other width the two round differently and a
    near-tie of random weights may flip a token (attention.cu choose_splits)."""
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    monkeypatch.setenv("FREETOKEN_MOE_DECODE", moe_decode)
    arch, shape = SHAPES["qwen3-30b-a3b"]
    tiny_hf_model(arch, tmp_path, seed=4, **shape)
    loaded = load_model(str(tmp_path), device="cuda")
    attached = sum(getattr(layer.mlp, "decode", None) is not None
                   for layer in loaded.model.layers)
    assert attached == (2 if moe_decode == "1" else 0)
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, max_num_seqs=8,
                                                     device="cuda"))
    assert engine.graphs is not None
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16,
                         table_width=engine.graphs.max_blocks)
    logits, eager = runner.step([(0, prompt)])[0], []
    for _ in range(12):
        eager.append(int(logits.argmax()))
        logits = runner.step([(0, eager[-1:])])[0]
    engine.start()

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    try:
        assert asyncio.run(run()) == eager
    finally:
        engine.shutdown()
