"""Offloaded FP8 experts stay FP8 on a GPU (engine/expert_pool.ScaledPool): logits bit-identical
to the resident FP8 model, eagerly and in decode graph segments. Skipped without a GPU.

The model: test_offload_gpu's random qwen3_moe (32 experts, 4 per token, 4 layers) quantized to
FP8 in 128x128 blocks (tests/models/scaled_checkpoint.py, the DeepSeek/Qwen layout). Resident
and offloaded steps launch the same kernels on the same bytes: decode steps moe_experts_scaled
(over the resident stack with the identity map, or the pool's slots through the expert map),
prompt steps dequantize a layer's E experts (the resident stack, or the staging buffer's E
slots) for moe_experts. So every logit must match bit for bit, whatever the rate (0.1 overflows
batch-4 decode into the staging buffer).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_offload_gpu import (PROMPTS, SHAPE,
                                          assert_driver_copies_give_the_resident_logits,
                                          assert_resident_logits, offloaded_model, run_fixed)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def scaled_moe_dir(tmp_path_factory, layout: str):
    """test_offload_gpu's random qwen3_moe written in a scaled checkpoint `layout`."""
    from tests.models.helpers import tiny_hf_model
    from tests.models.scaled_checkpoint import write_scaled

    base = tmp_path_factory.mktemp(f"offload-{layout}")
    (base / "float").mkdir()
    tiny_hf_model("qwen3_moe", base / "float", seed=5, **SHAPE)
    directory, _ = write_scaled(base / "float", base / layout, layout)
    return directory


def resident_runs(directory, fmt: str) -> dict:
    """(batch, graphs) -> the resident model's tokens and logits, its experts in `fmt`."""
    from freetoken.models.loader import load_model

    model = load_model(str(directory), device="cuda").model
    assert all(layer.mlp.scaled is not None and layer.mlp.scaled.weights[0].format == fmt
               for layer in model.layers)
    return {(b, g): run_fixed(model, PROMPTS[:b], graphs=g) for b in (1, 4) for g in (False, True)}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return scaled_moe_dir(tmp_path_factory, "fp8-block")


@pytest.fixture(scope="module")
def resident(fp8_dir):
    from freetoken.models.quant import scaled

    return resident_runs(fp8_dir, scaled.FP8)


def host_expert_bytes(cache) -> int:
    """One expert's host bytes (values, scale grids, row scales if any) of w13 and w2."""
    return sum(t[0].numel() * t[0].element_size() for w in (cache.host_w13[0], cache.host_w2[0])
               for t in (w.data, w.scales, w.row_scale) if t is not None)


def test_offloaded_experts_stay_fp8(fp8_dir):
    from freetoken.engine.expert_pool import ScaledPool
    from freetoken.models.checkpoint.footprint import weight_bytes
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.test_footprint import gpu_placement

    loaded, cache = offloaded_model(fp8_dir, 0.25)
    pool = cache.pool
    assert isinstance(pool, ScaledPool) and cache.in_format and not cache.fuses_decode
    assert pool.parts[0].dtype == torch.float8_e4m3fn and pool.parts[0].is_cuda
    for w in cache.host_w13 + cache.host_w2:
        assert w.data.dtype == torch.float8_e4m3fn and w.data.is_pinned()
        assert w.scales.dtype == torch.float32 and w.scales.is_pinned()
    # a slot holds about half a bf16 expert's bytes (a byte a weight, a scale per block)
    cfg = loaded.config
    assert pool.slot_bytes < 3 * cfg.hidden_size * cfg.moe.intermediate_size * 2 * 0.55
    # the memory plan counted the pool's slots
    config, tensors, _, _ = read_hf_dir(fp8_dir)
    assert weight_bytes(tensors, config, gpu_placement()).expert_slot == pool.slot_bytes
    assert cache.pinned_bytes == 4 * 32 * host_expert_bytes(cache)


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
@pytest.mark.parametrize("rate", [0.5, 0.1])
def test_offloaded_fp8_gives_the_resident_logits_bit_for_bit(fp8_dir, resident, rate, graphs,
                                                             prefetch):
    loaded, cache = offloaded_model(fp8_dir, rate, prefetch=prefetch)
    assert cache.num_slots == int(rate * 128)
    s = assert_resident_logits(loaded.model, cache, resident, graphs)
    # every byte moved is the checkpoint's: a miss copies one expert, a streamed layer all 32
    copied = s["expert_misses"] + s["expert_prefetched"] + 8 * 32
    assert s["expert_bytes_h2d"] == copied * host_expert_bytes(cache)
    if not prefetch:
        assert s["expert_prefetched"] == 0
    cache.check_integrity()


def test_decode_graphs_stop_at_the_widest_mapped_step(fp8_dir):
    """Batches wider than moe_experts_scaled takes (8) stream every layer: the segments are
    captured up to 8 sequences, wider batches run eagerly."""
    from freetoken.engine.segment_graphs import capture_decode_graphs
    from freetoken.models.forward.scaled_linear import GEMV_MAX_TOKENS
    from tests.models.helpers import PagedRunner

    loaded, cache = offloaded_model(fp8_dir, 0.5)
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16)
    graphs = capture_decode_graphs(loaded.model, runner.kv, 12, 8, cache)
    assert graphs is not None, "capturing the decode graphs failed (see the log)"
    assert graphs.sizes[-1] == GEMV_MAX_TOKENS


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
def test_driver_copies_give_the_resident_logits_bit_for_bit(fp8_dir, resident, graphs,
                                                             monkeypatch):
    assert_driver_copies_give_the_resident_logits(fp8_dir, resident, graphs, monkeypatch)
