"""NVFP4 experts kept in their format on a GPU, resident and offloaded (engine/expert_pool.
ScaledPool over packed e2m1 values and e4m3 scales): offloaded logits bit-identical to the
resident NVFP4 model, eagerly and in decode graph segments. Skipped without a GPU.

The loader keeps NVFP4 experts in format where weights.SCALED_EXPERT_FORMATS names NVFP4;
these tests name it, so they exercise the in-format path whatever the default. The model:
test_offload_gpu's random qwen3_moe quantized to compressed-tensors NVFP4
(tests/models/scaled_checkpoint.py). Resident and offloaded steps launch the same kernels on the
same bytes, so every logit must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_offload_gpu import PROMPTS, SHAPE, offloaded_model, run_fixed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", autouse=True)
def nvfp4_experts_in_format():
    from freetoken.models.checkpoint import weights
    from freetoken.models.quant import scaled

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(weights, "SCALED_EXPERT_FORMATS", (scaled.FP8, scaled.NVFP4))
        yield


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    from tests.models.helpers import tiny_hf_model
    from tests.models.scaled_checkpoint import write_scaled

    base = tmp_path_factory.mktemp("offload-nvfp4")
    (base / "float").mkdir()
    tiny_hf_model("qwen3_moe", base / "float", seed=5, **SHAPE)
    directory, _ = write_scaled(base / "float", base / "nvfp4", "ct-nvfp4")
    return directory


@pytest.fixture(scope="module")
def resident(nvfp4_dir):
    from freetoken.models.loader import load_model
    from freetoken.models.quant import scaled

    model = load_model(str(nvfp4_dir), device="cuda").model
    assert all(layer.mlp.scaled is not None and layer.mlp.scaled.weights[0].format ==
               scaled.NVFP4 for layer in model.layers)
    return {(b, g): run_fixed(model, PROMPTS[:b], graphs=g) for b in (1, 4) for g in (False, True)}


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
    for batch in (1, 4):
        tokens, steps = run_fixed(loaded.model, PROMPTS[:batch], cache, graphs)
        want_tokens, want_steps = resident[batch, graphs]
        assert tokens == want_tokens
        for i, (got, want) in enumerate(zip(steps, want_steps)):
            assert torch.equal(got, want), (batch, i, (got - want).abs().max())
    s = cache.stats.as_dict()
    assert s["expert_misses"] > 0 and s["expert_streamed_layers"] == 8
    cache.check_integrity()
