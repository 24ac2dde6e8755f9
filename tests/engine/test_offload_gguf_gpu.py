"""Offloaded GGUF experts stay in their blocks on a GPU (engine/expert_pool.BlockPool): logits
bit-identical to the resident model in the same format, eagerly and in decode graph segments.
Skipped without a GPU.

The model: a Qwen3-MoE written directly in llama.cpp's Q4_K_M mix (benchmarks/write_gguf_moe.py:
Q4_K gate/up experts everywhere, Q6_K down experts in the layers llama-quantize gives more bits,
Q4_K in the others), 32 experts, 4 per token, 4 layers, so one pool's slots hold experts of two
block mixes. Resident and offloaded steps launch the same kernels on the same blocks (decode:
moe_q8_gate_up / moe_q8_down through a slot map; prompt steps: the dequantized chunks over a
whole layer), so every logit must match bit for bit, whatever the rate (0.1 overflows batch-4
decode into the staging buffer).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.engine.test_offload_gpu import (PROMPTS,
                                          assert_driver_copies_give_the_resident_logits,
                                          assert_resident_logits, offloaded_model, run_fixed)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from benchmarks import write_gguf_moe as w

    shape = replace(w.TINY, layers=4, hidden=256, experts=32, top_k=4, expert_ffn=256,
                    heads=4, kv_heads=2, head_dim=64, vocab=512)
    path = tmp_path_factory.mktemp("offload-gguf") / "tiny-q4km.gguf"
    w.write_q4_k_m(path, shape, seed=3, progress=None)
    return path


@pytest.fixture(scope="module")
def resident(gguf_path):
    from freetoken.models.loader import load_model

    model = load_model(str(gguf_path), device="cuda").model
    assert any(getattr(layer.mlp, "decode", None) is not None for layer in model.layers)
    return {(b, g): run_fixed(model, PROMPTS[:b], graphs=g) for b in (1, 4) for g in (False, True)}


def test_offloaded_experts_keep_their_blocks(gguf_path):
    loaded, cache = offloaded_model(gguf_path, 0.25)
    pool = cache.pool
    assert cache.in_format and pool.pool.dtype == torch.uint8
    mixes = set(pool.qtypes)
    assert len(mixes) == 2, mixes                      # Q4_K/Q6_K and Q4_K/Q4_K layers
    assert all(w.dtype == torch.uint8 and w.is_pinned() for w in cache.host_w13 + cache.host_w2)
    widest = max(a + b for a, b in zip(pool.bytes13, pool.bytes2))
    assert pool.slot_bytes == -(-widest // 256) * 256
    # a slot holds a quarter of a bf16 expert's bytes or so (4.5-6.6 bits a weight)
    cfg = loaded.config
    assert pool.slot_bytes < 3 * cfg.hidden_size * cfg.moe.intermediate_size * 2 * 0.45
    assert cache.pinned_bytes == sum(w.numel() for w in cache.host_w13 + cache.host_w2)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
@pytest.mark.parametrize("rate", [0.5, 0.1, 0.999])
def test_offloaded_blocks_give_the_resident_logits_bit_for_bit(gguf_path, resident, rate,
                                                               graphs, prefetch):
    loaded, cache = offloaded_model(gguf_path, rate, prefetch=prefetch)
    assert cache.num_slots == max(4, int(rate * 128))
    s = assert_resident_logits(loaded.model, cache, resident, graphs)
    # every byte moved is a block's: a miss copies one expert's gate/up and down rows
    assert s["expert_bytes_h2d"] < (s["expert_misses"] + s["expert_prefetched"]) * \
        cache.expert_bytes + 8 * cache.pool.num_experts * cache.expert_bytes
    if prefetch and rate < 0.999:
        assert s["expert_prefetched"] > 0
    if not prefetch:
        assert s["expert_prefetched"] == 0
    cache.check_integrity()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
def test_driver_copies_give_the_resident_logits_bit_for_bit(gguf_path, resident, graphs,
                                                             monkeypatch):
    assert_driver_copies_give_the_resident_logits(gguf_path, resident, graphs, monkeypatch)
