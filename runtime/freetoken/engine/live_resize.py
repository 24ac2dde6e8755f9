"""Pool sizes in the stats, and resizing the KV pool, the recurrent-state pool (hybrid models)
and the expert cache while serving.

A resize runs between two engine steps (the engine holds its step lock): the plan is checked
first against what the device has free now, and under --gpu-memory-limit against the limit
less what the process holds (a new pool is allocated beside the old one while the pages or
slots that stay are copied over, so the check asks for the whole new pool), and a refusal
changes nothing. Page ids, state slots and expert slots below the new size keep their
data, so the requests in flight continue on the same pages and states.
"""

from __future__ import annotations

import copy
from typing import Any

from freetoken.engine.expert_slots import OffloadStats
from freetoken.engine.memory_plan import (HOST_MARGIN, MemoryPlan, MemoryPlanError, ModelSizes,
                                          cache_slots, host_available_bytes, measure_gpu_room)
from freetoken.models.batch import KVCache


class ResizeBusy(RuntimeError):
    """A KV (or state pool) shrink would drop pages (slots) that running requests hold."""


def _nbytes(array) -> int:
    return int(array.numel() * array.element_size()) if hasattr(array, "numel") \
        else int(array.nbytes)


def pool_stats(engine) -> dict[str, Any]:
    """Pool sizes, device and pinned bytes, the GPU memory limit and the expert cache's
    totals."""
    kv = engine.kv
    cache = getattr(engine, "expert_cache", None)
    moe = engine.model.config.moe
    limit = engine.config.gpu_memory_limit
    stats: dict[str, Any] = {
        "kv_pool_tokens": engine.pool.num_pages * engine.pool.block_size,
        "kv_pool_bytes": sum(_nbytes(t) for t in kv.k + kv.v),
        "moe_offload": cache is not None,
        "vram_allocated_bytes": 0, "vram_reserved_bytes": 0,
        "gpu_memory_limit": "none" if limit is None else str(limit),
        "gpu_memory_limit_bytes": None,
    }
    if not engine.arrays.device.is_cpu:
        import torch

        dev = engine.arrays.torch_device
        stats.update(vram_allocated_bytes=torch.cuda.memory_allocated(dev),
                     vram_reserved_bytes=torch.cuda.memory_reserved(dev),
                     gpu_memory_limit_bytes=measure_gpu_room(dev, limit).limit)
    if cache is not None:
        stats.update(moe_cache_rate=cache.num_slots / (cache.num_layers * cache.num_experts),
                     expert_cache_slots=cache.num_slots, expert_pool_bytes=cache.pool_bytes,
                     pinned_bytes=cache.pinned_bytes, **cache.stats.as_dict())
    else:
        total = moe.num_experts * sum(moe.sparse_layers) if moe else 0
        stats.update(moe_cache_rate=1.0 if moe else 0.0, expert_cache_slots=total,
                     expert_pool_bytes=_resident_expert_bytes(engine, total),
                     pinned_bytes=0, **OffloadStats().as_dict())
    if engine.states is not None:
        stats.update(engine.states.stats())
    return stats


def _resident_expert_bytes(engine, total: int) -> int:
    """Every resident expert's bytes: the start-up plan's (each in its on-device format), else
    (no plan: the CPU) the activation dtype's arithmetic."""
    plan = getattr(engine, "memory_plan", None)
    if plan is not None and "experts" in plan.pools:
        return plan.pools["experts"]
    if not total:
        return 0
    return total * ModelSizes.of(engine.model.config, engine.model.dtype).expert_bytes


def apply_resize(engine, kv_tokens: int | None, moe_rate: float | None,
                 states: int | None = None) -> dict[str, Any]:
    """Resize now (the caller holds the step lock and the engine lock); returns pool_stats.
    Raises MemoryPlanError (does not fit), ResizeBusy (pages or slots in use), ValueError (bad
    size)."""
    pool, cache = engine.pool, getattr(engine, "expert_cache", None)
    cfg, bs = engine.model.config, pool.block_size
    new_pages = pool.num_pages if kv_tokens is None else kv_tokens // bs
    if new_pages < 1:
        raise ValueError(f"--kv {kv_tokens} is less than one page ({bs} tokens)")
    new_slots = None
    if moe_rate is not None:
        if cfg.moe is None:
            raise ValueError("--moe: this model has no experts")
        if cache is None and moe_rate < 1.0:
            raise ValueError("every expert is resident (the server started with "
                             "--moe-cache-rate 1, or auto found room for all): restart with "
                             "--moe-cache-rate below 1 to resize the expert cache live")
        if cache is not None:
            new_slots = cache_slots(ModelSizes.of(cfg, engine.model.dtype), moe_rate)
    kv_per_token = ModelSizes.of(cfg, engine.model.dtype, engine.kv_dtype,
                                 mtp_kv=getattr(engine, "mtp", None) is not None
                                 ).kv_bytes_per_token
    pools = {}
    if new_pages != pool.num_pages:
        pools["kv"] = new_pages * bs * kv_per_token
    if new_slots is not None and new_slots != cache.num_slots:
        pools["expert_cache"] = (new_slots + 2 * cache.num_experts) * cache.expert_bytes
    new_states = _state_slots(engine, states)
    if new_states != (engine.states.num_slots if engine.states else 0):
        pools["states"] = new_states * engine.states.bytes_per_slot
    _check_fits(engine, pools)
    if new_pages < pool.num_pages and pool.pages_held_from(new_pages):
        raise ResizeBusy(f"{pool.pages_held_from(new_pages)} KV pages past the new size "
                         f"({new_pages} pages) are held by running requests; pass --wait "
                         f"SECONDS to wait for them to finish")
    if "states" in pools and engine.states.held_from(new_states):
        raise ResizeBusy(f"{engine.states.held_from(new_states)} recurrent-state slots past "
                         f"the new size ({new_states} slots) are held by running requests; "
                         f"pass --wait SECONDS to wait for them to finish")
    if "kv" in pools:
        _resize_kv(engine, new_pages)
    if "states" in pools:
        _resize_states(engine, new_states)
    if "expert_cache" in pools:
        cache.resize(new_slots)
    # graphs hold the KV, state and expert pools' addresses
    if pools and engine.graphs is not None:
        engine.graphs = engine.recapture_graphs()
    return pool_stats(engine)


def _state_slots(engine, states: int | None) -> int:
    """The state pool's new size in slots (its current one when not asked to change)."""
    if states is None:
        return engine.states.num_slots if engine.states else 0
    if engine.states is None:
        raise ValueError("--states: this model has no recurrent-state (linear attention) layers")
    if not 1 <= states <= engine.config.max_num_seqs:
        raise ValueError(f"--states {states} must be between 1 and --max-num-seqs "
                         f"({engine.config.max_num_seqs}): a slot per running sequence, more "
                         f"are never used")
    return states


def _check_fits(engine, pools: dict[str, int]) -> None:
    if not pools:
        return
    fix = "ask for less, or shrink the other pool first; the old pools keep serving"
    if engine.arrays.device.is_cpu:
        available = host_available_bytes()
        if available is not None:
            MemoryPlan("the host", pools, HOST_MARGIN, available).check(fix)
        return
    room = measure_gpu_room(engine.arrays.torch_device, engine.config.gpu_memory_limit)
    try:
        MemoryPlan("the GPU", pools, room.margin, room.available, limit=room.limit).check(fix)
    except MemoryPlanError as exc:
        raise MemoryPlanError(f"{exc} (the new pool is allocated beside the old one while "
                              f"what stays is copied over)") from None


def _resize_kv(engine, new_pages: int) -> None:
    """A new KV pool; a hybrid model's state arrays move over as they are (not copied)."""
    old, bs, cfg = engine.kv, engine.pool.block_size, engine.model.config
    # NOTE: num_state_slots=0 allocates one-slot state arrays, replaced below at once
    new = KVCache(cfg, new_pages, bs, engine.kv_dtype, engine.arrays)
    keep = min(old.num_slots, new.num_slots)
    for layer in range(cfg.num_layers):
        if cfg.is_linear(layer):
            new.k[layer], new.v[layer] = old.k[layer], old.v[layer]
            continue
        new.k[layer][:keep] = old.k[layer][:keep]
        new.v[layer][:keep] = old.v[layer][:keep]
    new.num_state_slots = old.num_state_slots
    engine.pool.resize(new_pages)
    _swap_kv(engine, new)


def _resize_states(engine, num_slots: int) -> None:
    """New state arrays of `num_slots` slots in the KV cache; slots below both sizes keep their
    states (running sequences hold only those: the caller checked)."""
    # a new KVCache object (sharing the attention pools): the model converts a cache's arrays
    # to kernel arguments once per object
    kv, cfg = copy.copy(engine.kv), engine.model.config
    kv.k, kv.v = list(kv.k), list(kv.v)
    keep = min(kv.num_state_slots, num_slots)
    for layer in range(cfg.num_layers):
        if not cfg.is_linear(layer):
            continue
        for pools in (kv.k, kv.v):
            old = pools[layer]
            new = engine.arrays.empty((num_slots,) + tuple(old.shape[1:]),
                                      str(old.dtype).replace("torch.", ""))
            new[...] = 0   # graph padding may read a slot no sequence wrote
            new[:keep] = old[:keep]
            pools[layer] = new
    kv.num_state_slots = num_slots
    engine.states.resize(num_slots)
    _swap_kv(engine, kv)


def _swap_kv(engine, new) -> None:
    engine.kv = new
    mtp = getattr(engine, "mtp", None)
    if mtp is not None and mtp.kv.num_blocks != new.num_blocks:
        mtp.resize(new.num_blocks, engine.kv_dtype)   # its drafts rebuild as sequences run
    if engine.scheduler.snapshots is not None:   # copies to and from the live state arrays
        engine.scheduler.snapshots.kv = new
