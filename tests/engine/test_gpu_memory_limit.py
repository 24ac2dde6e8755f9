"""--gpu-memory-limit: parsing every accepted form and the refusals, the plan under a limit (a
24 GiB card reproduced on a bigger GPU plans as that card does), the start-up planner and the
live resize check. torch.cuda is stubbed with the numbers of an imaginary GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken.engine import live_resize
from freetoken.engine.config import (EngineConfig, EngineConfigError, GpuMemoryLimit,
                                     parse_gpu_memory_limit)
from freetoken.engine.memory_plan import (GIB, MemoryPlanError, ModelSizes, GpuRoom,
                                          cache_slots, gpu_margin, plan_gpu, staging_slots)
from freetoken.engine.offload_setup import OffloadConfig, OffloadPlanner

MIB = 1 << 20
# A Qwen3-30B-A3B shape: 48 MoE layers of 128 experts (H 2048, I 768, bf16), 3.3 GB of other
# weights, 96 KiB of KV a token.
EXPERT = 3 * 2048 * 768 * 2
SIZES = ModelSizes(expert_bytes=EXPERT, num_experts=128, moe_layers=48, top_k=8,
                   other_weight_bytes=3_300_000_000, kv_bytes_per_token=48 * 2 * 512 * 2)
WS = 64 * MIB


@pytest.mark.parametrize("text,size", [
    ("24GiB", 24 * GIB), ("24gib", 24 * GIB), ("24 GiB", 24 * GIB), ("24G", 24 * GIB),
    ("24g", 24 * GIB), ("24GB", 24 * 10**9), ("512MiB", 512 * MIB), ("512M", 512 * MIB),
    ("512MB", 512 * 10**6), ("1.5GiB", 3 * GIB // 2), ("65536KiB", 64 * MIB),
    ("2048K", 2 * MIB), ("4000KB", 4 * 10**6), ("1TiB", 1 << 40), ("16000000000", 16 * 10**9),
    ("1048576", MIB), ("24GiB ", 24 * GIB)])
def test_sizes(text, size):
    limit = parse_gpu_memory_limit(text)
    assert limit == GpuMemoryLimit(size=size, text=text.strip())
    assert limit.bytes_on(2 << 40) == size


@pytest.mark.parametrize("text,fraction", [("0.5", 0.5), ("1", 1.0), ("1.0", 1.0),
                                           (".25", 0.25), ("0.3", 0.3)])
def test_fractions_are_shares_of_the_device(text, fraction):
    limit = parse_gpu_memory_limit(text)
    assert limit.fraction == fraction and limit.size == 0
    assert limit.bytes_on(80 * GIB) == int(fraction * 80 * GIB)


def test_none_is_the_whole_device():
    assert parse_gpu_memory_limit("none") is None and parse_gpu_memory_limit(None) is None
    assert EngineConfig().gpu_memory_limit is None


@pytest.mark.parametrize("text,fragment", [
    ("0", "FRACTION must be in (0, 1]"), ("0.0", "FRACTION must be in (0, 1]"),
    ("1.5", "FRACTION must be in (0, 1]"), ("-0.5", "must be positive"),
    ("-24GiB", "must be positive"), ("0GiB", "more than 0 bytes"),
    ("24", "write the unit (24GiB)"), ("24XB", "must be a SIZE"), ("bogus", "must be a SIZE"),
    ("GiB", "must be a SIZE"), ("24 Gibibytes", "must be a SIZE"), ("", None)])
def test_bad_values_name_the_flag_and_the_forms(text, fragment):
    if fragment is None:     # empty: the flag's default (no limit)
        assert parse_gpu_memory_limit(text) is None
        return
    with pytest.raises(EngineConfigError) as info:
        parse_gpu_memory_limit(text)
    message = str(info.value)
    assert "--gpu-memory-limit" in message and fragment in message and "\n" not in message


def test_a_size_beyond_the_device_is_refused():
    with pytest.raises(EngineConfigError, match=r"--gpu-memory-limit 100GiB is more than this "
                                                r"GPU's 80.00 GiB.*FRACTION"):
        parse_gpu_memory_limit("100GiB").bytes_on(80 * GIB)
    with pytest.raises(EngineConfigError, match="gpu_memory_limit must be None or a"):
        EngineConfig(gpu_memory_limit="24GiB")


# ---- the plan under a limit ------------------------------------------------------------------

def test_a_24_gib_limit_on_an_80_gib_gpu_plans_as_a_24_gib_card():
    """Same pools, rate, KV pool and margin (5% of 24 GiB, not of 80) as the card itself."""
    card = plan_gpu(SIZES, rate="auto", num_tokens="auto", free=24 * GIB, total=24 * GIB,
                    workspace=WS, min_tokens=16384)
    limited = plan_gpu(SIZES, rate="auto", num_tokens="auto", free=79 * GIB, total=80 * GIB,
                       workspace=WS, min_tokens=16384, limit=24 * GIB)
    whole = plan_gpu(SIZES, rate="auto", num_tokens="auto", free=79 * GIB, total=80 * GIB,
                     workspace=WS, min_tokens=16384)
    assert limited[1:] == card[1:] and limited[0].pools == card[0].pools
    assert limited[0].margin == card[0].margin == int(24 * GIB * 0.05) != whole[0].margin
    assert limited[0].needed <= 24 * GIB
    # the whole device keeps every expert; the limit offloads them, at the largest rate
    assert whole[1] == 1.0 and 0 < limited[1] < 1
    assert 0 <= 24 * GIB - limited[0].needed < 2 * EXPERT


def test_the_limit_counts_what_the_process_holds_and_free_memory_still_caps():
    held = plan_gpu(SIZES, rate=0.1, num_tokens="auto", free=70 * GIB, total=80 * GIB,
                    workspace=WS, min_tokens=4096, limit=24 * GIB, held=2 * GIB)[0]
    assert held.free == 22 * GIB and held.limit == 24 * GIB
    busy = plan_gpu(SIZES, rate=0.1, num_tokens="auto", free=20 * GIB, total=80 * GIB,
                    workspace=WS, min_tokens=4096, limit=24 * GIB)[0]
    assert busy.free == 20 * GIB          # another process uses the rest of the device
    assert GpuRoom(5 * GIB, 80 * GIB, 24 * GIB, 30 * GIB).available == 0
    assert GpuRoom(5 * GIB, 80 * GIB).margin == gpu_margin(80 * GIB) == 4 * GIB
    assert GpuRoom(5 * GIB, 80 * GIB, 12 * GIB).margin == GIB      # at least 1 GiB


def test_auto_kv_shrinks_to_the_limit():
    _, _, whole = plan_gpu(SIZES, rate=0.1, num_tokens="auto", free=79 * GIB, total=80 * GIB,
                           workspace=WS, min_tokens=4096)
    plan, _, tokens = plan_gpu(SIZES, rate=0.1, num_tokens="auto", free=79 * GIB,
                               total=80 * GIB, workspace=WS, min_tokens=4096, limit=24 * GIB)
    experts = (cache_slots(SIZES, 0.1) + staging_slots(SIZES)) * EXPERT
    left = 24 * GIB - int(24 * GIB * 0.05) - 3_300_000_000 - 256 * MIB - WS - experts
    assert tokens == left // SIZES.kv_bytes_per_token < whole
    assert plan.pools["kv"] == tokens * SIZES.kv_bytes_per_token


def test_a_plan_beyond_the_limit_is_refused_with_its_numbers():
    with pytest.raises(MemoryPlanError) as info:
        plan_gpu(SIZES, rate=0.5, num_tokens=100_000, free=79 * GIB, total=80 * GIB,
                 workspace=WS, min_tokens=4096, limit=24 * GIB)
    text = str(info.value)
    for words in ("weights 3.07 GiB", "expert_cache", "kv 9.16 GiB", "graphs", "margin 1.20 GiB",
                  "within --gpu-memory-limit 24.00 GiB", "raise --gpu-memory-limit",
                  "--num-tokens", "--moe-cache-rate"):
        assert words in text, (words, text)


def test_resident_experts_count_in_their_format_and_a_cache_in_float_slots():
    """GGUF blocks resident at 0.56 bytes a weight fit where bf16 would not; offloaded, the
    slots are bf16 (what the expert cache allocates)."""
    blocks = SIZES.__class__(**{**SIZES.__dict__, "expert_bytes": 3 * 2048 * 768 * 9 // 16,
                                "slot_bytes": EXPERT})
    plan, rate, _ = plan_gpu(blocks, rate="auto", num_tokens=16384, free=79 * GIB,
                             total=80 * GIB, workspace=WS, min_tokens=16384, limit=24 * GIB)
    assert rate == 1.0 and plan.pools["experts"] == 128 * 48 * blocks.expert_bytes
    plan, rate, _ = plan_gpu(blocks, rate=0.25, num_tokens=16384, free=79 * GIB,
                             total=80 * GIB, workspace=WS, min_tokens=16384, limit=24 * GIB)
    assert plan.pools["expert_cache"] == (cache_slots(blocks, 0.25) + 256) * EXPERT


# ---- the start-up planner and the live resize --------------------------------------------

class FakeGPU:
    is_cpu = False

    def __str__(self) -> str:
        return "cuda:0"


def stub_gpu(monkeypatch, free: int, total: int, reserved: int = 0) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def dense_config():
    from freetoken.models.config import ModelConfig

    # 32 layers, 8 KV heads of 128: 128 KiB of bf16 KV a token
    return ModelConfig("llama", 32000, 4096, 11008, 32, 32, 8, 128, 1e-5, 1e4, 8192)


@pytest.mark.parametrize("limit", ["24GiB", "0.25"])
def test_the_planner_sizes_auto_kv_from_the_limit(monkeypatch, limit):
    stub_gpu(monkeypatch, 95 * GIB, 96 * GIB, reserved=512 * MIB)
    config = EngineConfig(max_num_seqs=64, max_prefill_tokens=256,
                          gpu_memory_limit=parse_gpu_memory_limit(limit))
    planner = OffloadPlanner(config, OffloadConfig(), FakeGPU())
    assert planner(dense_config(), "bfloat16") is False
    plan = planner.decision.plan
    assert plan.limit == 24 * GIB and plan.free == 24 * GIB - 512 * MIB
    assert plan.margin == int(24 * GIB * 0.05) and plan.needed <= plan.free
    assert plan.free - plan.needed < ModelSizes.of(dense_config(), "bfloat16").kv_bytes_per_token


def test_the_planner_refuses_a_limit_beyond_the_device(monkeypatch):
    stub_gpu(monkeypatch, 23 * GIB, 24 * GIB)
    config = EngineConfig(gpu_memory_limit=parse_gpu_memory_limit("80GiB"))
    with pytest.raises(EngineConfigError, match="--gpu-memory-limit 80GiB is more than"):
        OffloadPlanner(config, OffloadConfig(), FakeGPU())(dense_config(), "bfloat16")


def fake_engine(limit: str | None):
    """What apply_resize reads of an engine serving a dense model on a GPU (no allocation:
    the check runs first)."""
    pool = SimpleNamespace(num_pages=256, block_size=16, pages_held_from=lambda page: 0)
    return SimpleNamespace(
        pool=pool, expert_cache=None, states=None, kv_dtype="bfloat16", graphs=None,
        model=SimpleNamespace(config=dense_config(), dtype="bfloat16"),
        arrays=SimpleNamespace(device=FakeGPU(), torch_device="cuda:0"),
        config=EngineConfig(gpu_memory_limit=parse_gpu_memory_limit(limit)))


def test_a_live_resize_keeps_to_the_limit(monkeypatch):
    """21.5 GiB held of a 24 GiB limit on an 80 GiB GPU leave 1.3 GiB beside the margin (1.2
    GiB): a new KV pool of 2 GiB is refused (the device's free memory alone would take it), one
    of 1 GiB fits."""
    stub_gpu(monkeypatch, 58 * GIB, 80 * GIB, reserved=43 * GIB // 2)
    resized = []
    monkeypatch.setattr(live_resize, "_resize_kv", lambda engine, pages: resized.append(pages))
    monkeypatch.setattr(live_resize, "pool_stats", lambda engine: {})
    per_token = ModelSizes.of(dense_config(), "bfloat16").kv_bytes_per_token
    tokens = 2 * GIB // per_token
    live_resize.apply_resize(fake_engine(None), tokens, None)
    with pytest.raises(MemoryPlanError, match=r"within --gpu-memory-limit 24.00 GiB.*beside "
                                              r"the old one"):
        live_resize.apply_resize(fake_engine("24GiB"), tokens, None)
    live_resize.apply_resize(fake_engine("24GiB"), tokens // 2, None)
    assert resized == [tokens // 16, tokens // 2 // 16]


@pytest.mark.parametrize("limit,text,nbytes", [(None, "none", None),
                                               ("0.3", "0.3", int(0.3 * 80 * GIB)),
                                               ("24GiB", "24GiB", 24 * GIB)])
def test_stats_show_the_limit(monkeypatch, limit, text, nbytes):
    stub_gpu(monkeypatch, 58 * GIB, 80 * GIB, reserved=GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: GIB)
    engine = fake_engine(limit)
    engine.kv = SimpleNamespace(k=[], v=[])
    stats = live_resize.pool_stats(engine)
    assert stats["gpu_memory_limit"] == text and stats["gpu_memory_limit_bytes"] == nbytes
