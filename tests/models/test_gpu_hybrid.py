"""The hybrid models on the GPU at Qwen3.6-35B-A3B's layer shapes (4 of 40 layers: 3 Gated
DeltaNet + 1 gated full attention, 256 experts top-8 with a shared expert): our bf16 forward
against HF transformers' float32 (and HF's own bf16, as the yardstick), the same methodology as
test_gpu_vs_hf.py; and decode replayed from CUDA graphs gives the eager tokens. Skipped without
a CUDA GPU.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.models.helpers import PagedRunner
from tests.models.test_hybrid_hf import build_hybrid
from tests.tolerances import EPS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QWEN36 = dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
              linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, max_position_embeddings=4096,
              rms_norm_eps=1e-6, layer_types=["linear_attention"] * 3 + ["full_attention"])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_gpu_hybrid_logits_match_transformers(tmp_path, moe_ops):
    from freetoken.models.loader import load_model

    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=3, **QWEN36)
    hf32 = hf.to("cuda")
    hf16 = type(hf)(hf.config).to("cuda", torch.bfloat16).eval()
    hf16.load_state_dict(hf32.state_dict())
    loaded = load_model(str(tmp_path), device="cuda")
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, hf.config.vocab_size, (70,), generator=gen).tolist()
    tokens, ours, errors = list(prompt), [runner.step([(0, prompt)])[0]], []
    for _ in range(10):
        with torch.no_grad():
            ref = hf32(torch.tensor([tokens], device="cuda")).logits[0, -1]
            ref16 = hf16(torch.tensor([tokens], device="cuda")).logits[0, -1]
        nxt = int(ref.argmax())
        top2, noise = ref.topk(2).values, (ref16.float() - ref).abs().max()
        errors.append((_rel(ours[-1], ref), _rel(ref16, ref)))
        if ((top2[0] - top2[1]) > 2 * noise).item():
            assert int(ours[-1].argmax()) == nxt, (len(tokens), top2.tolist(), noise.item())
        tokens.append(nxt)
        ours.append(runner.step([(0, [nxt])])[0])
    # MoE: a bf16 rounding may flip a near-tied expert choice on some step (see
    # test_gpu_vs_hf.py), so the bound holds for the mean over the steps
    ours_mean = sum(e for e, _ in errors) / len(errors)
    hf16_mean = sum(e for _, e in errors) / len(errors)
    assert ours_mean < max(2.0 * hf16_mean, 2 * EPS["bfloat16"]), errors


def test_hybrid_decode_in_cuda_graphs_gives_the_eager_tokens(tmp_path, moe_ops):
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model

    # the GPU recurrence takes key heads of 64, 128 or 256
    build_hybrid("qwen3_next", tmp_path, seed=2, head_dim=64, linear_key_head_dim=64,
                 linear_value_head_dim=32)
    loaded = load_model(str(tmp_path), device="cuda")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (9, 30, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        config = EngineConfig(num_tokens=512, block_size=16, max_num_seqs=4,
                              cuda_graphs=graphs, prefix_cache=False)
        engine = Engine.from_loaded(loaded, config).start()

        async def one(prompt):
            return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        try:
            results[graphs] = asyncio.run(main())
        finally:
            engine.shutdown()
    assert results[True] == results[False]


def test_offloaded_hybrid_decodes_in_graph_segments_with_the_resident_tokens(tmp_path,
                                                                             moe_ops):
    """qwen3_next with its experts offloaded (6 slots of 3 MoE layers x 8 experts; layer 1 is
    a dense MLP, so the MoE layers are decoder layers 0, 2 and 3): decode graph segments around
    the GDN and attention layers give the resident graphs' tokens, one request at a time."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.offload_setup import OffloadDecision
    from freetoken.engine.request import SamplingParams
    from freetoken.engine.segment_graphs import SegmentedDecodeGraphs
    from freetoken.models.loader import load_model

    build_hybrid("qwen3_next", tmp_path, seed=2, head_dim=64, linear_key_head_dim=64,
                 linear_value_head_dim=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    config = EngineConfig(num_tokens=512, block_size=16, max_num_seqs=4, prefix_cache=False)
    results, prompts = {}, None
    for rate in (1.0, 0.25):
        offload = rate < 1.0
        loaded = load_model(str(tmp_path), device="cuda",
                            plan=(lambda cfg, dtype, weights: True) if offload else None)
        if prompts is None:
            gen = torch.Generator().manual_seed(4)
            prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
                       for n in (9, 30, 17)]
        decision = OffloadDecision(rate, 512, None, None, False) if offload else None
        for layer in loaded.model.layers:   # the same MoE kernel as the offloaded layers
            if getattr(getattr(layer, "mlp", None), "decode", None) is not None:
                layer.mlp.decode = None
        engine = Engine.from_loaded(loaded, config, decision).start()

        async def one(prompt):
            return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

        try:
            assert isinstance(engine.graphs, SegmentedDecodeGraphs) == offload
            results[rate] = [asyncio.run(one(p)) for p in prompts]
            if offload:
                assert len(engine.graphs.segments[1]) == 3 + 1
                assert engine.stats()["expert_misses"] > 0
                engine.expert_cache.check_integrity()
        finally:
            engine.shutdown()
    assert results[0.25] == results[1.0]
