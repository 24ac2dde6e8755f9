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


# A Qwen3.6-35B-A3B-shaped hybrid: 40 layers, 30 of them Gated DeltaNet (16 key / 32 value heads
# of 128, conv kernel 4), 10 full attention (2 KV heads of 256); bf16.
def qwen36_config():
    from freetoken.models.config import LinearAttentionConfig, ModelConfig

    linear = LinearAttentionConfig(num_k_heads=16, num_v_heads=32, head_k_dim=128,
                                   head_v_dim=128, conv_kernel=4)
    return ModelConfig("qwen3_5_moe", 248320, 2048, 512, 40, 16, 2, 256, 1e-6, 1e7, 262144,
                       linear=linear, linear_layers=tuple(i % 4 != 3 for i in range(40)))


# one slot: per GDN layer the conv inputs (2*16*128 + 32*128 channels x 3 taps, bf16) and the
# f32 state (32 heads x 128 x 128)
STATE_SLOT = 30 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4)


def test_hybrid_sizes_count_attention_kv_and_the_state_slot():
    from freetoken.models.batch import KVCache

    cfg = qwen36_config()
    sizes = ModelSizes.of(cfg, "bfloat16")
    assert sizes.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2     # the 10 attention layers only
    assert sizes.state_bytes_per_slot == STATE_SLOT == \
        KVCache.bytes_per_state_slot(cfg, "bfloat16")
    assert ModelSizes.of(SIZES_CONFIG(), "bfloat16").state_bytes_per_slot == 0


def test_mtp_drafting_counts_the_blocks_kv_pool():
    import dataclasses

    from freetoken.models.forward.mtp import MTPBlock

    cfg = dataclasses.replace(qwen36_config(), mtp_num_hidden_layers=1)
    plain = ModelSizes.of(cfg, "bfloat16").kv_bytes_per_token
    drafting = ModelSizes.of(cfg, "bfloat16", mtp_kv=True).kv_bytes_per_token
    # one more attention layer's K and V: what MTPBlock.create_kv_cache allocates per token
    assert drafting - plain == 2 * 2 * 256 * 2 == MTPBlock.kv_bytes_per_token(
        type("Block", (), {"config": cfg.mtp_block(), "dtype": "bfloat16"})())
    assert ModelSizes.of(qwen36_config(), "bfloat16", mtp_kv=True).kv_bytes_per_token == plain


def SIZES_CONFIG():
    from freetoken.models.config import ModelConfig

    return ModelConfig("llama", 10, 8, 16, 2, 2, 2, 4, 1e-6, 1e4, 32)


HYBRID = ModelSizes(expert_bytes=3 * 2048 * 512 * 2, num_experts=256, moe_layers=40, top_k=8,
                    other_weight_bytes=3_000_000_000, kv_bytes_per_token=10 * 2 * 512 * 2,
                    state_bytes_per_slot=STATE_SLOT)


def test_auto_kv_leaves_the_state_pool_and_its_snapshots_out():
    free, total = 100 * GIB, 141 * GIB
    plain, _, plain_tokens = plan_gpu(HYBRID, rate=1.0, num_tokens="auto", free=free,
                                      total=total, workspace=WS, min_tokens=4096)
    plan, _, tokens = plan_gpu(HYBRID, rate=1.0, num_tokens="auto", free=free, total=total,
                               workspace=WS, min_tokens=4096, state_slots=8, snapshots=16)
    assert plan.pools["states"] == 8 * STATE_SLOT
    assert plan.pools["state_snapshots"] == 16 * STATE_SLOT
    assert "states" not in plain.pools
    left = free - plan.margin - 3_000_000_000 - GRAPH_BYTES - WS - 24 * STATE_SLOT \
        - 256 * 40 * HYBRID.expert_bytes
    assert tokens == left // HYBRID.kv_bytes_per_token
    assert plain_tokens - tokens == pytest.approx(24 * STATE_SLOT / HYBRID.kv_bytes_per_token,
                                                  abs=1)


def test_a_state_pool_that_does_not_fit_is_refused_with_its_numbers():
    with pytest.raises(MemoryPlanError) as info:
        plan_gpu(HYBRID, rate=0.1, num_tokens=4096, free=12 * GIB, total=16 * GIB,
                 workspace=WS, min_tokens=4096, state_slots=128, snapshots=0)
    text = str(info.value)
    per = f"{STATE_SLOT / (1 << 20):.1f} MiB"
    for words in ("states 7.68 GiB", f"128 slots x {per}", "--max-num-seqs", "kv", "free"):
        assert words in text, (words, text)
    with pytest.raises(MemoryPlanError, match="--max-num-seqs"):
        plan_host(HYBRID, pinned_experts=False, num_tokens=4096, available=4 * GIB,
                  on_cpu=True, state_slots=64, snapshots=128)


def test_fp8_kv_holds_the_full_context_in_24_gib_with_more_room_for_experts():
    """Qwen3.6-35B-A3B at its 262,144-token context on a 24 GiB card: an FP8 pool takes 10,400
    bytes a token (10 layers x K and V x 2 heads x 256 x (1 + 4/256): a byte an element and a
    float32 scale per head), about half of bf16's, and `auto` gives the experts what it saves."""
    import dataclasses

    cfg = qwen36_config()
    fp8_token = ModelSizes.of(cfg, "bfloat16", "fp8").kv_bytes_per_token
    assert fp8_token == 10 * 2 * 2 * 256 + 10 * 2 * 2 * 4 == 10_400
    plans = {}
    for name, per_token in (("bf16", HYBRID.kv_bytes_per_token), ("fp8", fp8_token)):
        sizes = dataclasses.replace(HYBRID, kv_bytes_per_token=per_token)
        plans[name] = plan_gpu(sizes, rate="auto", num_tokens=262144, free=23 * GIB,
                               total=24 * GIB, workspace=WS, min_tokens=4096, state_slots=1,
                               snapshots=2)
    (bf16, bf16_rate, _), (fp8, fp8_rate, fp8_tokens) = plans["bf16"], plans["fp8"]
    assert fp8_tokens == 262144 and fp8.pools["kv"] == 262144 * 10_400 and fp8.needed <= fp8.free
    assert fp8_rate > bf16_rate
    saved = bf16.pools["kv"] - fp8.pools["kv"]
    assert fp8.pools["expert_cache"] - bf16.pools["expert_cache"] == pytest.approx(
        saved, abs=2 * HYBRID.expert_bytes)
