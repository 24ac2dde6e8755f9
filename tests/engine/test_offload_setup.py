"""The start-up planner (load_model's plan hook) on the CPU: torch.cuda.mem_get_info is stubbed
with the free and total bytes of an imaginary GPU, so the decisions are checked by hand."""

from __future__ import annotations

import pytest
import torch

from freetoken.engine.config import EngineConfig, EngineConfigError
from freetoken.engine.memory_plan import GIB, MemoryPlanError, ModelSizes
from freetoken.engine.offload_setup import OffloadConfig, OffloadPlanner, parse_cache_rate
from tests.models.helpers import tiny_hf_model


class FakeGPU:
    is_cpu = False

    def __str__(self) -> str:
        return "cuda:0"


@pytest.fixture(scope="module")
def moe_config(tmp_path_factory):
    from freetoken.models.checkpoint.hf import read_hf_dir

    directory = tmp_path_factory.mktemp("plan-moe")
    tiny_hf_model("qwen3_moe", directory, num_experts=64, num_experts_per_tok=4,
                  moe_intermediate_size=512, hidden_size=512, num_hidden_layers=4)
    return read_hf_dir(directory)[0]


def planner_with(monkeypatch, free, total, rate=None, num_tokens=0):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    config = EngineConfig(num_tokens=num_tokens, max_num_seqs=4, max_prefill_tokens=256)
    return OffloadPlanner(config, OffloadConfig(cache_rate=rate), FakeGPU())


def test_everything_fits_so_the_experts_stay_resident(moe_config, monkeypatch):
    planner = planner_with(monkeypatch, 40 * GIB, 48 * GIB)
    assert planner(moe_config, "bfloat16") is False
    d = planner.decision
    assert d.rate == 1.0 and not d.offloaded and d.host_plan is None
    # auto KV: capped at max_num_seqs full contexts
    assert d.num_tokens == 4 * moe_config.max_position


def test_a_small_gpu_offloads_at_the_largest_rate_that_fits(moe_config, monkeypatch):
    sizes = ModelSizes.of(moe_config, "bfloat16")
    experts = sizes.total_experts * sizes.expert_bytes          # 4 layers * 64 * 1.5 MiB
    # 1.5 GiB free: 1 GiB margin and 256 MiB of graphs leave less than the 384 MiB of experts
    total, free = 1.6 * GIB, int(1.5 * GIB)
    planner = planner_with(monkeypatch, free, total, num_tokens=1024)
    assert planner(moe_config, "bfloat16") is True
    d = planner.decision
    assert 0 < d.rate < 1 and d.offloaded and d.num_tokens == 1024
    assert d.plan.needed <= free < d.plan.needed + 2 * sizes.expert_bytes
    assert d.host_plan.pools == {"pinned_experts": experts}


def test_an_explicit_rate_offloads_even_when_everything_fits(moe_config, monkeypatch):
    planner = planner_with(monkeypatch, 40 * GIB, 48 * GIB, rate=0.25)
    assert planner(moe_config, "bfloat16") is True
    assert planner.decision.rate == 0.25
    assert planner.decision.plan.pools["expert_cache"] == \
        (64 + 2 * 64) * ModelSizes.of(moe_config, "bfloat16").expert_bytes


def test_a_plan_that_cannot_fit_is_refused_before_loading(moe_config, monkeypatch):
    planner = planner_with(monkeypatch, 1 * GIB, 1 * GIB + 200 * (1 << 20), num_tokens=10**8)
    with pytest.raises(MemoryPlanError, match=r"does not fit on the GPU: needs .* kv "):
        planner(moe_config, "bfloat16")


def test_cache_rate_parsing():
    assert parse_cache_rate("auto") is None and parse_cache_rate(" AUTO ") is None
    assert parse_cache_rate("0.25") == 0.25 and parse_cache_rate("1") == 1.0
    for bad in ("0", "-0.1", "1.01", "half"):
        with pytest.raises(EngineConfigError, match="moe-cache-rate"):
            parse_cache_rate(bad)
    with pytest.raises(EngineConfigError, match="moe-cpu"):
        OffloadConfig(cpu="sometimes")
    with pytest.raises(EngineConfigError, match="moe-prefetch"):
        OffloadConfig(prefetch="auto")


def test_a_hybrid_plan_counts_its_state_slots_and_snapshots(tmp_path, monkeypatch):
    """The state pool (one slot per --max-num-seqs) and its snapshot rows (two per slot with
    the prefix cache) come out of the auto KV pool, and name themselves in a refusal."""
    from freetoken.engine.offload_setup import state_rows, workspace_bytes
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.test_hybrid_hf import build_hybrid

    build_hybrid("qwen3_5_moe", tmp_path, max_position_embeddings=1 << 26)   # no KV cap
    cfg = read_hf_dir(tmp_path)[0]
    per_slot = ModelSizes.of(cfg, "bfloat16").state_bytes_per_slot
    assert per_slot == 3 * cfg.linear.state_bytes(2)
    assert state_rows(cfg, EngineConfig(max_num_seqs=4)) == {"state_slots": 4, "snapshots": 8}
    assert state_rows(cfg, EngineConfig(max_num_seqs=4, prefix_cache=False))["snapshots"] == 0
    tokens = {}
    for seqs in (1, 4):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * GIB, 8 * GIB))
        config = EngineConfig(max_num_seqs=seqs, max_prefill_tokens=256)
        planner = OffloadPlanner(config, OffloadConfig(), FakeGPU())
        planner(cfg, "bfloat16")
        plan = planner.decision.plan
        assert plan.pools["states"] == seqs * per_slot
        assert plan.pools["state_snapshots"] == 2 * seqs * per_slot
        tokens[seqs] = planner.decision.num_tokens
    kv = ModelSizes.of(cfg, "bfloat16").kv_bytes_per_token
    grown = workspace_bytes(cfg, "bfloat16", 260) - workspace_bytes(cfg, "bfloat16", 257)
    assert tokens[1] - tokens[4] == pytest.approx((9 * per_slot + grown) / kv, abs=1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 * GIB, 2 * GIB))
    with pytest.raises(MemoryPlanError, match=r"states .*slots x .*--max-num-seqs"):
        OffloadPlanner(EngineConfig(max_num_seqs=4, num_tokens=1 << 30), OffloadConfig(),
                       FakeGPU())(cfg, "bfloat16")
