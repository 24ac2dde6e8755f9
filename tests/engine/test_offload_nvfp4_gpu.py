"""NVFP4 experts kept in their format on a GPU, resident and offloaded (engine/expert_pool.
ScaledPool over packed e2m1 values and e4m3 scales): offloaded logits bit-identical to the
resident NVFP4 model, eagerly and in decode graph segments. Skipped without a GPU.

The model:
test_offload_gpu's random qwen3_moe quantized to compressed-tensors NVFP4
(tests/models/scaled_checkpoint.py). Resident and offloaded steps launch the same kernels on the
same bytes, so every logit must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_offload_fp8_gpu import resident_runs, scaled_moe_dir
from tests.engine.test_offload_gpu import assert_resident_logits, offloaded_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    return scaled_moe_dir(tmp_path_factory, "ct-nvfp4")


@pytest.fixture(scope="module")
def resident(nvfp4_dir):
    from freetoken.models.quant import scaled

    return resident_runs(nvfp4_dir, scaled.NVFP4)


def test_offloaded_experts_stay_nvfp4(nvfp4_dir):
    from freetoken.engine.expert_pool import ScaledPool
    from freetoken.models.checkpoint.footprint import weight_bytes
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.test_footprint import gpu_placement

    loaded, cache = offloaded_model(nvfp4_dir, 0.25)
    pool = cache.pool
    assert isinstance(pool, ScaledPool) and pool.parts[0].dtype == torch.uint8
    assert pool.parts[1].dtype == torch.float8_e4m3fn and pool.parts[0].is_cuda
    assert all(w.data.is_pinned() and w.scales.is_pinned() for w in cache.host_w13)
    # about a quarter of a bf16 expert's bytes (half a byte a weight, a byte per 16)
    cfg = loaded.config
    assert pool.slot_bytes < 3 * cfg.hidden_size * cfg.moe.intermediate_size * 2 * 0.33
    config, tensors, _, _ = read_hf_dir(nvfp4_dir)
    assert weight_bytes(tensors, config, gpu_placement()).expert_slot == pool.slot_bytes


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-segments"])
@pytest.mark.parametrize("rate", [0.5, 0.1])
def test_offloaded_nvfp4_gives_the_resident_logits_bit_for_bit(nvfp4_dir, resident, rate,
                                                               graphs):
    loaded, cache = offloaded_model(nvfp4_dir, rate, prefetch=True)
    s = assert_resident_logits(loaded.model, cache, resident, graphs)
    assert s["expert_prefetched"] > 0
    cache.check_integrity()
