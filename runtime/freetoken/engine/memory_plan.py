"""One memory plan per device: weights, KV pool, recurrent-state slots, expert slots, graphs and
workspaces, and a margin.

The plan is pure arithmetic over the model config, so it is checked before anything is
allocated (start-up and ``ft ctl cache``); a plan that does not fit is refused with per-pool
numbers. "auto" values (the expert-cache rate, the KV pool size) are resolved here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.engine.config import EngineConfigError

GIB = 1 << 30
MIB = 1 << 20
# Kept free on the GPU for the CUDA context's own growth, cuBLAS workspaces and allocator
# fragmentation: 5% of the device or 1 GiB, whichever is larger.
MARGIN_FRACTION, MARGIN_MIN = 0.05, GIB
# Decode CUDA graphs and the per-step temporaries (logits, sampling) beside the workspace.
GRAPH_BYTES = 256 * MIB
# The host keeps this much RAM for the OS, the tokenizer and Python itself (edge machines
# have little to spare).
HOST_MARGIN = 512 * MIB
_ITEM = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(EngineConfigError):
    """A memory plan does not fit; the message names every pool with its bytes."""


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@dataclass(frozen=True)
class ModelSizes:
    """What the plan needs from a model config (bytes per unit, counts)."""

    expert_bytes: int        # one routed expert (gate, up and down) in the activation dtype
    num_experts: int         # per MoE layer
    moe_layers: int
    top_k: int
    other_weight_bytes: int  # everything that is not a routed expert (always on the device)
    kv_bytes_per_token: int  # K and V of every attention layer
    state_bytes_per_slot: int = 0   # hybrid models: one sequence's GDN states, every layer

    @property
    def total_experts(self) -> int:
        return self.num_experts * self.moe_layers

    @classmethod
    def of(cls, cfg, dtype: str, kv_dtype: str | None = None) -> ModelSizes:
        item, kv_item = _ITEM[dtype], _ITEM[kv_dtype or dtype]
        moe = cfg.moe
        expert_params = 3 * cfg.hidden_size * moe.intermediate_size if moe else 0
        layers = sum(moe.sparse_layers) if moe else 0
        experts = moe.num_experts if moe else 0
        kv = 2 * len(cfg.kv_layers) * cfg.kv_size * kv_item   # GDN layers keep no K/V
        other = cfg.num_params - expert_params * experts * layers
        lin = getattr(cfg, "linear", None)
        state = sum(cfg.linear_layers) * lin.state_bytes(item) if lin is not None else 0
        return cls(expert_params * item, experts, layers, moe.top_k if moe else 0,
                   other * item, kv, state)

    def state_pools(self, slots: int, snapshots: int) -> tuple[dict[str, int], dict[str, str]]:
        """The recurrent-state pools of a hybrid model (none for others): a slot per running
        sequence and the snapshot rows beside them; with their per-slot arithmetic."""
        per = self.state_bytes_per_slot
        if not per or not slots:
            return {}, {}
        pools, notes = {"states": slots * per}, {"states": f"{slots} slots x {fmt_bytes(per)}"}
        if snapshots:
            pools["state_snapshots"] = snapshots * per
            notes["state_snapshots"] = f"{snapshots} x {fmt_bytes(per)}"
        return pools, notes


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes by pool on one device, the margin kept free and what the device has free."""

    device: str
    pools: dict[str, int] = field(default_factory=dict)
    margin: int = 0
    free: int = 0
    notes: dict[str, str] = field(default_factory=dict)   # pool -> how its size was reached

    @property
    def needed(self) -> int:
        return sum(self.pools.values()) + self.margin

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    def describe(self) -> str:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" + (f" ({self.notes[k]})" if k in self.notes
                                                     else "") for k, v in self.pools.items())
        return (f"{self.device}: needs {fmt_bytes(self.needed)} ({parts}, margin "
                f"{fmt_bytes(self.margin)}), {fmt_bytes(self.free)} free")

    def check(self, fix: str) -> MemoryPlan:
        if not self.fits:
            raise MemoryPlanError(f"the memory plan does not fit on {self.describe()}; {fix}")
        return self


def gpu_margin(total: int) -> int:
    return max(MARGIN_MIN, int(total * MARGIN_FRACTION))


def cache_slots(sizes: ModelSizes, rate: float) -> int:
    """Expert slots for a cache rate: the rate of every expert rounded down (so an auto rate
    never rounds past the room it was computed from), at least one layer's top-k."""
    return max(sizes.top_k, min(sizes.total_experts, int(rate * sizes.total_experts + 1e-6)))


def staging_slots(sizes: ModelSizes) -> int:
    """Two staging buffers of one layer's experts each: prefill streams whole layers through
    them (layer l + 1 copies while layer l computes), and a decode step whose misses do not fit
    beside its hits goes through the first."""
    return 2 * sizes.num_experts


def plan_gpu(sizes: ModelSizes, *, rate: float | str, num_tokens: int | str, free: int,
             total: int, workspace: int, min_tokens: int, state_slots: int = 0,
             snapshots: int = 0, extra: tuple[dict[str, int], dict[str, str]] = ({}, {})
             ) -> tuple[MemoryPlan, float, int]:
    """(plan, cache rate, KV tokens) for a GPU with `free` of `total` bytes free now.

    rate: 0 < R <= 1, or "auto": 1.0 when every expert fits beside the rest and a KV pool of
    `min_tokens`, else the largest rate that leaves room for that pool. num_tokens: an int,
    or "auto": every byte the other pools and the margin leave (at least `min_tokens`).
    state_slots / snapshots: a hybrid model's recurrent-state slots (--max-num-seqs) and
    snapshot rows, a pool of their own taken before the KV pool. extra: more fixed pools and
    their notes (a vision tower's, engine/vision_memory.py), also taken before the KV pool.
    Raises MemoryPlanError (with the per-pool numbers) when even that does not fit.
    """
    margin = gpu_margin(total)
    states, notes = sizes.state_pools(state_slots, snapshots)
    fixed = {"weights": sizes.other_weight_bytes, "graphs": GRAPH_BYTES, "workspace": workspace,
             **states, **extra[0]}
    notes = {**notes, **extra[1]}
    offloaded = sizes.total_experts > 0
    if rate == "auto":
        want_kv = (min_tokens if num_tokens == "auto" else int(num_tokens))
        room = free - margin - sum(fixed.values()) - want_kv * sizes.kv_bytes_per_token
        rate = 1.0
        if offloaded and room < sizes.total_experts * sizes.expert_bytes:
            room -= staging_slots(sizes) * sizes.expert_bytes
            rate = max(room, 0) / (sizes.total_experts * sizes.expert_bytes)
            rate = max(rate, sizes.top_k / sizes.total_experts)
    rate = float(rate)
    pools = dict(fixed)
    if offloaded:
        slots = cache_slots(sizes, rate) + (staging_slots(sizes) if rate < 1.0 else 0)
        pools["expert_cache" if rate < 1.0 else "experts"] = slots * sizes.expert_bytes
    if num_tokens == "auto":
        left = free - margin - sum(pools.values())
        num_tokens = max(min_tokens, left // max(sizes.kv_bytes_per_token, 1))
    pools["kv"] = int(num_tokens) * sizes.kv_bytes_per_token
    plan = MemoryPlan("the GPU", pools, margin, free, notes)
    plan.check("lower --num-tokens, or lower --moe-cache-rate (experts then live in pinned "
               "host memory)" + (", or lower --max-num-seqs (a recurrent-state slot per "
                                 "sequence)" if states else "")
               + (", or lower --max-image-pixels" if "vision_workspace" in extra[0] else ""))
    return plan, rate, int(num_tokens)


def plan_host(sizes: ModelSizes, *, pinned_experts: bool, num_tokens: int,
              available: int | None, on_cpu: bool, state_slots: int = 0,
              snapshots: int = 0, extra: tuple[dict[str, int], dict[str, str]] = ({}, {})
              ) -> MemoryPlan:
    """The host RAM plan: on the CPU path every weight, the KV pool and the `extra` pools (as
    plan_gpu's); with offload the pinned copy of every expert. `sizes` of the CPU path should
    count weights at the bytes per parameter they keep in memory (GGUF blocks stay quantized
    there)."""
    pools: dict[str, int] = {}
    notes: dict[str, str] = {}
    if on_cpu:
        pools["weights"] = sizes.other_weight_bytes + sizes.total_experts * sizes.expert_bytes
        pools["kv"] = num_tokens * sizes.kv_bytes_per_token
        states, notes = sizes.state_pools(state_slots, snapshots)
        pools.update(states)
        pools.update(extra[0])
        notes = {**notes, **extra[1]}
    elif pinned_experts:
        pools["pinned_experts"] = sizes.total_experts * sizes.expert_bytes
    plan = MemoryPlan("the host", pools, HOST_MARGIN, available or 0, notes)
    if available is None:    # unknown (no /proc/meminfo): nothing to check against
        return plan
    return plan.check("lower --num-tokens" + (" or --max-num-seqs (a recurrent-state slot per "
                                               "sequence)" if notes else "")
                      + ", or serve a smaller (or quantized) model")


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
