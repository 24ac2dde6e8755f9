"""The memory plan and the co-execution policy: pure arithmetic, checked by hand-computed
numbers of a Qwen3-30B-A3B-shaped model."""

from __future__ import annotations

import pytest

from freetoken.engine.memory_plan import (GIB, GRAPH_BYTES, MemoryPlanError, ModelSizes,
                                          cache_slots, gpu_margin, plan_gpu, plan_host,
                                          staging_slots)
from freetoken.engine.offload_policy import CoExecPolicy, Throughput

# 48 MoE layers of 128 experts (H 2048, I 768, bf16), 3.3 GB of other weights, 96 KiB of KV a
# token (48 layers * 2 * 4 heads * 128 * 2 bytes).
EXPERT = 3 * 2048 * 768 * 2
SIZES = ModelSizes(expert_bytes=EXPERT, num_experts=128, moe_layers=48, top_k=8,
                   other_weight_bytes=3_300_000_000, kv_bytes_per_token=48 * 2 * 512 * 2)
WS = 64 << 20


def test_auto_rate_is_one_when_everything_fits():
    plan, rate, tokens = plan_gpu(SIZES, rate="auto", num_tokens="auto", free=139 * GIB,
                                  total=141 * GIB, workspace=WS, min_tokens=16384)
    assert rate == 1.0 and plan.pools["experts"] == 128 * 48 * EXPERT
    others = plan.margin + 3_300_000_000 + GRAPH_BYTES + WS + 128 * 48 * EXPERT
    assert tokens == (139 * GIB - others) // SIZES.kv_bytes_per_token
    assert plan.needed <= plan.free and tokens >= 16384


def test_auto_rate_on_a_24_gb_gpu_leaves_room_for_the_kv_pool():
    free = 22 * GIB
    plan, rate, tokens = plan_gpu(SIZES, rate="auto", num_tokens=16384, free=free,
                                  total=24 * GIB, workspace=WS, min_tokens=16384)
    assert 0.0 < rate < 1.0
    slots = cache_slots(SIZES, rate) + staging_slots(SIZES)
    assert plan.pools["expert_cache"] == slots * EXPERT
    assert plan.pools["kv"] == 16384 * SIZES.kv_bytes_per_token
    # what is left after every pool and the margin is less than one more expert slot or so
    assert 0 <= free - plan.needed < 2 * EXPERT
    assert plan.margin == gpu_margin(24 * GIB) == int(24 * GIB * 0.05)


def test_a_plan_that_does_not_fit_names_every_pool():
    with pytest.raises(MemoryPlanError) as info:
        plan_gpu(SIZES, rate=0.5, num_tokens=100_000, free=16 * GIB, total=16 * GIB,
                 workspace=WS, min_tokens=16384)
    text = str(info.value)
    for word in ("weights", "expert_cache", "kv", "graphs", "margin", "free", "--num-tokens",
                 "--moe-cache-rate"):
        assert word in text, (word, text)


def test_auto_kv_takes_what_is_left():
    plan, rate, tokens = plan_gpu(SIZES, rate=0.1, num_tokens="auto", free=40 * GIB,
                                  total=48 * GIB, workspace=WS, min_tokens=4096)
    left = 40 * GIB - plan.margin - 3_300_000_000 - GRAPH_BYTES - WS - \
        (cache_slots(SIZES, 0.1) + staging_slots(SIZES)) * EXPERT
    assert tokens == left // SIZES.kv_bytes_per_token


def test_cache_slots_hold_at_least_one_layers_top_k():
    assert cache_slots(SIZES, 1e-6) == 8
    assert cache_slots(SIZES, 1.0) == 128 * 48
    assert cache_slots(SIZES, 0.2) == 1228         # 1228.8 rounded down


def test_host_plan_counts_the_pinned_experts():
    plan = plan_host(SIZES, pinned_experts=True, num_tokens=0, available=80 * GIB, on_cpu=False)
    assert plan.pools == {"pinned_experts": 128 * 48 * EXPERT}
    with pytest.raises(MemoryPlanError, match="pinned_experts"):
        plan_host(SIZES, pinned_experts=True, num_tokens=0, available=32 * GIB, on_cpu=False)
    with pytest.raises(MemoryPlanError, match="kv"):
        plan_host(SIZES, pinned_experts=False, num_tokens=10**7, available=80 * GIB,
                  on_cpu=True)


def policy(h2d: float, cpu_bw: float, flops: float, enabled: bool = True) -> CoExecPolicy:
    return CoExecPolicy(Throughput(h2d, cpu_bw, flops), EXPERT, 6 * 2048 * 768, enabled)


def test_policy_copies_everything_when_the_cpu_is_slow():
    p = policy(h2d=50e9, cpu_bw=5e9, flops=1e11)         # copy 0.19 ms, CPU 1.9 ms + FLOPs
    assert p.split({3: 1, 9: 1, 20: 4}) == ([3, 9, 20], [])


def test_policy_balances_copies_against_cpu_work():
    # copy 1.9 ms each; CPU 0.94 ms + 0.094 ms a token
    p = policy(h2d=5e9, cpu_bw=10e9, flops=1e11)
    misses = {e: 1 for e in range(10)}
    copy, cpu = p.split(misses)
    assert sorted(copy + cpu) == list(range(10)) and cpu
    copy_s, cpu_s = len(copy) * p.copy_seconds(), sum(p.cpu_seconds(1) for _ in cpu)
    assert cpu_s <= copy_s                                 # the CPU never finishes last
    # one more expert on the CPU would make the CPU side the longer one
    assert cpu_s + p.cpu_seconds(1) > copy_s - p.copy_seconds()


def test_policy_hands_the_cpu_the_experts_with_fewest_tokens():
    p = policy(h2d=5e9, cpu_bw=10e9, flops=1e11)
    copy, cpu = p.split({1: 50, 2: 1, 3: 40, 4: 2})
    assert set(cpu) <= {2, 4} and cpu


def test_policy_off_copies_every_miss():
    assert policy(1e6, 1e12, 1e15, enabled=False).split({5: 1, 2: 1}) == ([2, 5], [])


def test_host_plan_without_meminfo_checks_nothing():
    plan = plan_host(SIZES, pinned_experts=True, num_tokens=0, available=None, on_cpu=False)
    assert plan.pools["pinned_experts"] > 0
