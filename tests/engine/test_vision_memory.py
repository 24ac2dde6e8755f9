"""The vision tower in the memory plan: its weights counted as transformers builds them, the
encoder cache at capacity and the encoding work buffers come out of the auto KV pool and name
themselves in a refusal, on a (stubbed) GPU and on the CPU path; on a real GPU the work-buffer
estimate bounds what encoding the largest image allocates."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig
from freetoken.engine.memory_plan import GIB, MemoryPlanError, ModelSizes
from freetoken.engine.offload_setup import OffloadConfig, OffloadPlanner
from freetoken.engine.vision_memory import (VisionBudget, bytes_per_patch, step_patches,
                                            vision_pools)
from freetoken.engine.vision_setup import MIN_ENCODER_CACHE_ROWS
from freetoken.models.checkpoint.vision_config import vision_config_from_hf
from tests.models.vision_checkpoint import VISION, build_vision_model
from tests.vision.images import QWEN35_PREPROCESSOR

# Qwen3.5/3.6's released vision_config (transformers' Qwen3_5MoeVisionConfig defaults but the
# output width, which is the text model's hidden size: 2048 for Qwen3.6-35B-A3B)
QWEN36_VISION = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                     out_hidden_size=2048, num_position_embeddings=2304, patch_size=16,
                     temporal_patch_size=2, spatial_merge_size=2, hidden_act="gelu_pytorch_tanh")
RAW = {"model_type": "qwen3_5_moe", "text_config": {}}
# Qwen3-VL-8B's vision_config: three DeepStack mergers beside the final one
QWEN3_VL_VISION = dict(QWEN36_VISION, out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24])


class FakeGPU:
    is_cpu = False

    def __str__(self) -> str:
        return "cuda:0"


def hf_visual_params(vision: dict) -> int:
    from transformers import Qwen3_5MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    with torch.device("meta"):
        model = Qwen3_5MoeVisionModel(Qwen3_5MoeConfig(vision_config=vision).vision_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("vision", [VISION, QWEN36_VISION])
def test_tower_params_as_transformers_builds_them(vision):
    config = vision_config_from_hf({**RAW, "vision_config": vision}, "config.json")
    assert config.num_params == hf_visual_params(vision)


def test_qwen3_vl_tower_params_and_encoder_cache_width():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    config = vision_config_from_hf({"model_type": "qwen3_vl", "text_config": {},
                                    "vision_config": QWEN3_VL_VISION}, "config.json")
    with torch.device("meta"):
        model = Qwen3VLVisionModel(Qwen3VLConfig(vision_config=QWEN3_VL_VISION).vision_config)
    assert config.num_params == sum(p.numel() for p in model.parameters())
    # each cached row holds the embedding and the three features
    pools, notes = vision_pools(VisionBudget(config, 1 << 20), "bfloat16", 256)
    assert pools["encoder_cache"] == MIN_ENCODER_CACHE_ROWS * 4 * 4096 * 2
    assert "32.0 KiB" in notes["encoder_cache"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from freetoken.models.checkpoint.hf import read_hf_dir

    directory = tmp_path_factory.mktemp("plan-vision")
    build_vision_model(directory, seed=0, text={"max_position_embeddings": 1 << 26})
    return directory, read_hf_dir(directory)[0]


def test_vision_budget_reads_the_folder(checkpoint, tmp_path):
    import json

    from freetoken.cli.serve import vision_budget

    directory = checkpoint[0]
    default = vision_budget(str(directory), None)
    assert default.config.depth == VISION["depth"]
    assert default.max_pixels == 28 * 28 * 1280    # no preprocessor_config.json: HF defaults
    (directory / "preprocessor_config.json").write_text(json.dumps(QWEN35_PREPROCESSOR))
    try:
        assert vision_budget(str(directory), None).max_pixels == 16777216
        assert vision_budget(str(directory), 1 << 20).max_pixels == 1 << 20
    finally:
        (directory / "preprocessor_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert vision_budget(str(tmp_path), None) is None


def test_pools_of_the_qwen36_tower():
    """Hand-checked figures of the released tower in bfloat16 at 16,777,216 pixels (a
    4096x4096 image: 65,536 patches) with the default step of 2048 + 256 tokens."""
    config = vision_config_from_hf({**RAW, "vision_config": QWEN36_VISION}, "config.json")
    budget = VisionBudget(config, 16777216)
    pools, notes = vision_pools(budget, "bfloat16", 2304)
    assert pools["vision_weights"] == 2 * config.num_params
    assert 0.8 * GIB < pools["vision_weights"] < 0.9 * GIB        # ~446M parameters
    assert pools["encoder_cache"] == 8192 * 2048 * 2               # 32 MiB
    assert step_patches(budget, 2304) == 65536 + 4 * 2304
    # the patch embedding's peak: float32 pixels and their cast (1536 values), the residual,
    # 4 gathered position rows in bfloat16, their float32 blend and sum; the rotary tables
    per = bytes_per_patch(config, 2)
    assert per == 8 * 72 + 6 * 1536 + 2 * 1152 + (8 + 20) * 1152
    assert pools["vision_workspace"] == (65536 + 9216) * per
    assert "8192 rows" in notes["encoder_cache"] and "16777216 pixels" in notes[
        "vision_workspace"]


def plan(monkeypatch, cfg, budget, free=8 * GIB, num_tokens=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 * GIB))
    config = EngineConfig(num_tokens=num_tokens, max_num_seqs=4, max_prefill_tokens=256)
    planner = OffloadPlanner(config, OffloadConfig(cache_rate=1.0), FakeGPU(), budget)
    planner(cfg, "bfloat16")
    return planner.decision


def test_the_gpu_plan_leaves_room_for_images(checkpoint, monkeypatch):
    cfg = checkpoint[1]
    config = vision_config_from_hf({**RAW, "vision_config": QWEN36_VISION}, "config.json")
    budget = VisionBudget(config, 16777216)
    text_only = plan(monkeypatch, cfg, None)
    with_vision = plan(monkeypatch, cfg, budget)
    pools = with_vision.plan.pools
    expected, _ = vision_pools(budget, "bfloat16", 256 + 4)
    assert {k: pools[k] for k in expected} == expected
    assert pools["encoder_cache"] == MIN_ENCODER_CACHE_ROWS * 2048 * 2
    kv = ModelSizes.of(cfg, "bfloat16").kv_bytes_per_token
    fewer = text_only.num_tokens - with_vision.num_tokens
    assert fewer == pytest.approx(sum(expected.values()) / kv, abs=1)
    assert "vision_workspace" in with_vision.plan.describe()
    # too little room: refused, naming the vision pools and the flag that shrinks them
    with pytest.raises(MemoryPlanError) as info:
        plan(monkeypatch, cfg, budget, free=4 * GIB, num_tokens=4096)
    for word in ("vision_weights", "encoder_cache", "vision_workspace", "--max-image-pixels"):
        assert word in str(info.value), word
    # the same request fits with a smaller image limit
    small = plan(monkeypatch, cfg, VisionBudget(config, 1 << 20), free=4 * GIB,
                 num_tokens=4096)
    assert small.plan.pools["vision_workspace"] < pools["vision_workspace"] / 8


def test_the_cpu_plan_counts_the_tower_in_host_memory(checkpoint, monkeypatch):
    import freetoken.engine.offload_setup as setup

    cfg = checkpoint[1]
    config = vision_config_from_hf({**RAW, "vision_config": QWEN36_VISION}, "config.json")
    budget = VisionBudget(config, 16777216)
    cpu = type("CPU", (), {"is_cpu": True})()
    engine_config = EngineConfig(num_tokens=4096, max_num_seqs=4, max_prefill_tokens=256)
    needed = sum(vision_pools(budget, "float32", 260)[0].values())
    monkeypatch.setattr(setup, "host_available_bytes", lambda: needed + 2 * GIB)
    OffloadPlanner(engine_config, OffloadConfig(), cpu, budget)(cfg, "float32")
    monkeypatch.setattr(setup, "host_available_bytes", lambda: needed)
    with pytest.raises(MemoryPlanError, match="vision_weights.*encoder_cache"):
        OffloadPlanner(engine_config, OffloadConfig(), cpu, budget)(cfg, "float32")
    OffloadPlanner(engine_config, OffloadConfig(), cpu, None)(cfg, "float32")   # text: fits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_encoding_the_largest_image_stays_within_the_workspace_estimate(tmp_path):
    """The real vision width (depth cut to 2) in bfloat16: the peak allocated while encoding
    one image at the limit and a step's worth of small ones stays under the estimate."""
    from freetoken.arrays import parse_device
    from freetoken.models.vision_model import load_vision
    from tests.models.test_vision_gpu import REAL_VISION
    from tests.models.vision_checkpoint import image_processor, make_image, random_pixels

    build_vision_model(tmp_path, seed=2, vision=REAL_VISION)
    vision = load_vision(tmp_path, parse_device("cuda"), "bfloat16")
    limit = 2048 * 2048
    images = [make_image(random_pixels(2048, 2048, 0), image_processor(max_pixels=limit))]
    images += [make_image(random_pixels(64, 64, 1 + i)) for i in range(8)]
    step_tokens = sum(im.num_tokens(2) for im in images[1:])
    budget = VisionBudget(vision.config, limit)
    estimate = step_patches(budget, step_tokens) * bytes_per_patch(vision.config, 2)
    vision.tower.encode(images[:1])    # kernels loaded, caches warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = vision.tower.encode(images)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    kept = sum(o.numel() * o.element_size() for o in out)
    assert 0.3 * estimate < peak - kept <= estimate, (peak, kept, estimate)
