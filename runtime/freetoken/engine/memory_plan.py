"""One memory plan per device: weights, KV pool, recurrent-state slots, expert slots, graphs and
workspaces, and a margin.

The plan is pure arithmetic over the model config and the checkpoint's tensor table (each
weight in the bytes of the format it keeps on the device: models/checkpoint/footprint.py), so
it is checked before anything is allocated (start-up and ``ft ctl cache``); a plan that does
not fit is refused with per-pool numbers. "auto" values (the expert-cache rate, the KV pool
size) are resolved here too. On a GPU the budget is what the device has free, capped by
``--gpu-memory-limit`` (GpuRoom).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freetoken.engine.config import GIB, MIB, EngineConfigError, GpuMemoryLimit
from freetoken.models.batch import kv_bytes_per_element

if TYPE_CHECKING:
    from freetoken.models.checkpoint.footprint import WeightBytes

# Kept free on the GPU for the CUDA context's own growth, cuBLAS workspaces and allocator
# fragmentation: 5% of the device (of --gpu-memory-limit, when given) or 1 GiB, whichever is
# larger.
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

    expert_bytes: int        # one routed expert (gate, up and down) resident on the device, in
                             # the bytes of its format there (GGUF blocks, FP8 + scales, floats)
    num_experts: int         # per MoE layer
    moe_layers: int
    top_k: int
    other_weight_bytes: int  # everything that is not a routed expert (always on the device)
    kv_bytes_per_token: int  # K and V of every attention layer (and the MTP block's, drafting)
    state_bytes_per_slot: int = 0   # hybrid models: one sequence's GDN states, every layer
    # One slot of the offloaded experts' GPU pool, and one expert's pinned host copy: GGUF
    # blocks (the widest layer's expert) or FP8 values and scales where every MoE layer keeps
    # them, else floats of the activation dtype (0: the same as expert_bytes).
    slot_bytes: int = 0

    @property
    def total_experts(self) -> int:
        return self.num_experts * self.moe_layers

    @property
    def expert_slot_bytes(self) -> int:
        return self.slot_bytes or self.expert_bytes

    @classmethod
    def of(cls, cfg, dtype: str, kv_dtype: str | None = None,
           weights: WeightBytes | None = None, mtp_kv: bool = False) -> ModelSizes:
        """The sizes of a model config in activation dtype `dtype`. `weights` (the checkpoint's
        tensors in the bytes they keep on the device, models/checkpoint/footprint.py) replaces
        the weights' dtype arithmetic where the reader could tell; without it every parameter
        counts at the dtype's bytes. `mtp_kv`: the MTP block drafts, its K/V pool (one
        attention layer per MTP layer, engine/mtp_drafts.py) beside the model's."""
        item = _ITEM[dtype]
        kv_item = kv_bytes_per_element(kv_dtype or dtype, cfg.head_dim)
        moe = cfg.moe
        expert_params = 3 * cfg.hidden_size * moe.intermediate_size if moe else 0
        layers = sum(moe.sparse_layers) if moe else 0
        experts = moe.num_experts if moe else 0
        kv_layers = len(cfg.kv_layers)   # GDN layers keep no K/V
        if mtp_kv and getattr(cfg, "mtp_num_hidden_layers", 0):
            kv_layers += cfg.mtp_num_hidden_layers
        kv = round(2 * kv_layers * cfg.kv_size * kv_item)
        other = (cfg.num_params - expert_params * experts * layers) * item
        resident = slot = expert_params * item
        if weights is not None:
            other = weights.other
            if weights.experts is not None and experts * layers:
                # an average: a _K_M mix keeps some layers' experts in a wider block type
                resident = -(-weights.experts // (experts * layers))
            if getattr(weights, "expert_slot", None):
                slot = weights.expert_slot
        lin = getattr(cfg, "linear", None)
        state = sum(cfg.linear_layers) * lin.state_bytes(item) if lin is not None else 0
        return cls(resident, experts, layers, moe.top_k if moe else 0, other, kv, state, slot)

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
    """Bytes by pool on one device, the margin kept free and what the device has free (under
    `limit`, --gpu-memory-limit in bytes, when one is given)."""

    device: str
    pools: dict[str, int] = field(default_factory=dict)
    margin: int = 0
    free: int = 0
    notes: dict[str, str] = field(default_factory=dict)   # pool -> how its size was reached
    limit: int | None = None

    @property
    def needed(self) -> int:
        return sum(self.pools.values()) + self.margin

    @property
    def fits(self) -> bool:
        return self.needed <= self.free

    def describe(self) -> str:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" + (f" ({self.notes[k]})" if k in self.notes
                                                     else "") for k, v in self.pools.items())
        within = "" if self.limit is None else \
            f" within --gpu-memory-limit {fmt_bytes(self.limit)}"
        return (f"{self.device}: needs {fmt_bytes(self.needed)} ({parts}, margin "
                f"{fmt_bytes(self.margin)}), {fmt_bytes(self.free)} free{within}")

    def check(self, fix: str) -> MemoryPlan:
        if not self.fits:
            if self.limit is not None:
                fix += ", or raise --gpu-memory-limit"
            raise MemoryPlanError(f"the memory plan does not fit on {self.describe()}; {fix}")
        return self


def gpu_margin(total: int) -> int:
    return max(MARGIN_MIN, int(total * MARGIN_FRACTION))


@dataclass(frozen=True)
class GpuRoom:
    """What a GPU plan may use: `free` of `total` bytes free on the device now
    (torch.cuda.mem_get_info), capped by `limit` (--gpu-memory-limit in bytes; None = the whole
    device) less `held`, what this process's allocator already holds there (nothing much at
    start-up, where the plan runs before any weight is placed; every live pool at a live
    resize). The limit covers every pool the plan sizes (weights, KV, experts or the expert
    cache, recurrent states and snapshots, graphs, workspaces) and the margin; the CUDA
    context the driver holds before the allocator is outside it."""

    free: int
    total: int
    limit: int | None = None
    held: int = 0

    @property
    def available(self) -> int:
        if self.limit is None:
            return self.free
        return max(0, min(self.free, self.limit - self.held))

    @property
    def margin(self) -> int:
        """A share of the device, or of the limit: a 24 GiB limit on an 80 GiB GPU keeps the
        margin a 24 GiB card keeps."""
        return gpu_margin(self.total if self.limit is None else self.limit)


def measure_gpu_room(device, limit: GpuMemoryLimit | None) -> GpuRoom:
    """The room on torch device `device` now; EngineConfigError when `limit` is a size beyond
    the device."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    if limit is None:
        return GpuRoom(free, total)
    return GpuRoom(free, total, limit.bytes_on(total), torch.cuda.memory_reserved(device))


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
             snapshots: int = 0, extra: tuple[dict[str, int], dict[str, str]] = ({}, {}),
             limit: int | None = None, held: int = 0) -> tuple[MemoryPlan, float, int]:
    """(plan, cache rate, KV tokens) for a GPU with `free` of `total` bytes free now, under
    --gpu-memory-limit `limit` bytes of which this process holds `held` (see GpuRoom: the
    limit caps every pool below and the margin, which becomes a share of the limit).

    rate: 0 < R <= 1, or "auto": 1.0 when every expert fits beside the rest and a KV pool of
    `min_tokens`, else the largest rate that leaves room for that pool. num_tokens: an int,
    or "auto": every byte the other pools and the margin leave (at least `min_tokens`).
    state_slots / snapshots: a hybrid model's recurrent-state slots (--max-num-seqs) and
    snapshot rows, a pool of their own taken before the KV pool. extra: more fixed pools and
    their notes (a vision tower's, engine/vision_memory.py), also taken before the KV pool.
    Resident experts count at `sizes.expert_bytes` (their format), an expert cache at its
    slots (`sizes.expert_slot_bytes`, what the offload pool allocates: blocks, FP8 or floats).
    Raises MemoryPlanError (with the per-pool numbers) when even that does not fit.
    """
    budget = GpuRoom(free, total, limit, held)
    margin, free = budget.margin, budget.available
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
            slot = sizes.expert_slot_bytes
            room -= staging_slots(sizes) * slot
            rate = max(room, 0) / (sizes.total_experts * slot)
            rate = max(rate, sizes.top_k / sizes.total_experts)
    rate = float(rate)
    pools = dict(fixed)
    if offloaded and rate < 1.0:
        slots = cache_slots(sizes, rate) + staging_slots(sizes)
        pools["expert_cache"] = slots * sizes.expert_slot_bytes
    elif offloaded:
        pools["experts"] = sizes.total_experts * sizes.expert_bytes
    if num_tokens == "auto":
        left = free - margin - sum(pools.values())
        num_tokens = max(min_tokens, left // max(sizes.kv_bytes_per_token, 1))
    pools["kv"] = int(num_tokens) * sizes.kv_bytes_per_token
    plan = MemoryPlan("the GPU", pools, margin, free, notes, limit)
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
    plan_gpu's); with offload the pinned copy of every expert (at expert_slot_bytes).
    `sizes` of the CPU path should count weights at the bytes they keep in memory (GGUF
    blocks stay quantized there)."""
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
        pools["pinned_experts"] = sizes.total_experts * sizes.expert_slot_bytes
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
