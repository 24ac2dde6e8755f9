"""Expert offload set-up: the flags' config, the start-up memory plan (called by load_model once
the model's config is read, before any weight is placed) and attaching the expert cache to a
loaded model's MoE layers."""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, replace
from typing import Any

from freetoken.engine.config import EngineConfigError, default_num_tokens
from freetoken.engine.memory_plan import (MemoryPlan, MemoryPlanError, ModelSizes, cache_slots,
                                          fmt_bytes, host_available_bytes, measure_gpu_room,
                                          plan_gpu, plan_host)
from freetoken.engine.state_snapshots import SNAPSHOTS_PER_SLOT

log = logging.getLogger("freetoken.offload")
MOE_CPU_MODES = ("auto", "off")
MOE_PREFETCH_MODES = ("on", "off")


@dataclass(frozen=True)
class OffloadConfig:
    """cache_rate: fraction of every expert resident on the GPU (0 < R <= 1), None = auto (the
    largest that fits beside the weights, the KV pool and the graphs). cpu: "auto" lets the
    co-execution policy compute missed experts on the CPU; "off" (the default: on the measured
    host, copying a bf16 expert beat computing it with torch on the CPU) copies every miss.
    prefetch: "on" copies the next MoE layer's predicted misses while the current layer runs
    (engine/expert_prefetch.py); "off" copies each layer's misses when it routes."""

    cache_rate: float | None = None
    cpu: str = "off"
    prefetch: str = "off"

    def __post_init__(self) -> None:
        if self.cache_rate is not None and not 0.0 < self.cache_rate <= 1.0:
            raise EngineConfigError(f"--moe-cache-rate must be in (0, 1] or auto, got "
                                    f"{self.cache_rate}")
        if self.cpu not in MOE_CPU_MODES:
            raise EngineConfigError(f"--moe-cpu must be one of {MOE_CPU_MODES}, got {self.cpu!r}")
        if self.prefetch not in MOE_PREFETCH_MODES:
            raise EngineConfigError(f"--moe-prefetch must be one of {MOE_PREFETCH_MODES}, got "
                                    f"{self.prefetch!r}")


def parse_cache_rate(text: str) -> float | None:
    """'auto' -> None, else a float in (0, 1]; EngineConfigError names the flag otherwise."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        rate = float(text)
    except ValueError:
        raise EngineConfigError(f"--moe-cache-rate must be a number in (0, 1] or auto, got "
                                f"{text!r}") from None
    OffloadConfig(cache_rate=rate)
    return rate


@dataclass
class OffloadDecision:
    """What the start-up plan chose: the cache rate, the KV pool size and the plans."""

    rate: float
    num_tokens: int
    plan: MemoryPlan
    host_plan: MemoryPlan | None
    cpu: bool
    prefetch: bool = False

    @property
    def offloaded(self) -> bool:
        return self.rate < 1.0


def workspace_bytes(cfg, dtype: str, tokens: int, weights=None) -> int:
    """An upper estimate of the forward's work buffers for steps of `tokens` tokens, with the
    bf16 scratch that prefill dequantizes GGUF weights into when `weights` (WeightBytes) keeps
    blocks (forward/dequant.py)."""
    from freetoken.kernel.ops import moe_workspace_bytes
    from freetoken.models.forward.dequant import scratch_elements

    item = 4 if dtype == "float32" else 2
    scratch = 2 * scratch_elements(cfg) if getattr(weights, "blocks", False) else 0
    moe = cfg.moe
    widths = 8 * cfg.hidden_size + 2 * cfg.intermediate_size + cfg.q_size + 2 * cfg.kv_size
    if moe is None:
        return tokens * widths * item + scratch
    widths += moe.num_experts + 2 * moe.top_k + 3 * moe.shared_intermediate_size
    return scratch + tokens * widths * item + moe_workspace_bytes(
        tokens, moe.top_k, moe.num_experts, moe.intermediate_size, item)


def state_rows(cfg, engine_config) -> dict[str, int]:
    """A hybrid model's recurrent-state slots (one per sequence the engine runs at once) and
    the snapshot rows beside them (with the prefix cache), as the engine allocates them."""
    if getattr(cfg, "linear", None) is None:
        return {}
    slots = engine_config.max_num_seqs
    return {"state_slots": slots,
            "snapshots": SNAPSHOTS_PER_SLOT * slots if engine_config.prefix_cache else 0}


class OffloadPlanner:
    """The load_model `plan` hook: checks memory before any weight is placed and decides where
    the experts go. `decision` holds the result (None on the CPU path). `vision` (a
    VisionBudget, engine/vision_memory.py) counts a vision tower, its encoder cache and its
    work buffers beside the text model. On a GPU the budget is the free memory capped by the
    engine config's gpu_memory_limit (memory_plan.GpuRoom)."""

    def __init__(self, engine_config, offload: OffloadConfig, device: Any, vision: Any = None):
        self.config, self.offload, self.device = engine_config, offload, device
        self.vision = vision
        self.decision: OffloadDecision | None = None

    def _vision_pools(self, dtype: str) -> tuple[dict[str, int], dict[str, str]]:
        if self.vision is None:
            return {}, {}
        from freetoken.engine.vision_memory import vision_pools

        return vision_pools(self.vision, dtype,
                            self.config.max_prefill_tokens + self.config.max_num_seqs)

    def __call__(self, cfg, dtype: str, weights=None) -> bool:
        """`weights`: load_model's WeightBytes (each weight in its on-device format), or None
        to count every parameter at the dtype's bytes."""
        c = self.config
        min_tokens = default_num_tokens(cfg.max_position)
        extra = self._vision_pools(dtype)
        if self.device.is_cpu:
            self._check_host(cfg, dtype, weights, min_tokens, extra)
            return False
        import torch

        sizes = ModelSizes.of(cfg, dtype, weights=weights,
                              mtp_kv=c.speculative in ("mtp", "auto"))
        room = measure_gpu_room(torch.device(str(self.device)), c.gpu_memory_limit)
        rate = self.offload.cache_rate if cfg.moe is not None else 1.0
        tokens = c.num_tokens or "auto"
        plan, rate, num_tokens = plan_gpu(
            sizes, rate="auto" if rate is None else rate, num_tokens=tokens, free=room.free,
            total=room.total, workspace=workspace_bytes(cfg, dtype, c.max_prefill_tokens
                                                        + c.max_num_seqs, weights),
            min_tokens=min_tokens, extra=extra, limit=room.limit, held=room.held,
            **state_rows(cfg, c))
        if tokens == "auto":   # more KV than max_num_seqs full contexts is never used at once
            num_tokens = min(num_tokens, max(min_tokens, c.max_num_seqs * cfg.max_position))
        host = None
        if rate < 1.0:
            host = plan_host(sizes, pinned_experts=True, num_tokens=0,
                             available=host_available_bytes(), on_cpu=False)
        self.decision = OffloadDecision(rate, num_tokens, plan, host, self.offload.cpu == "auto",
                                        self.offload.prefetch == "on")
        log.info("memory plan: %s; expert cache rate %.3f, KV pool %d tokens", plan.describe(),
                 rate, num_tokens)
        return rate < 1.0

    def _check_host(self, cfg, dtype: str, weights, min_tokens: int, extra) -> None:
        """The CPU path's host RAM plan (every weight, the KV pool, states, extra pools)."""
        c = self.config
        if c.gpu_memory_limit is not None:
            log.warning("--gpu-memory-limit %s is ignored: the model runs on the CPU",
                        c.gpu_memory_limit)
        sizes = ModelSizes.of(cfg, dtype, "float16", weights,
                              mtp_kv=c.speculative in ("mtp", "auto"))
        if weights is None:
            # NOTE: GGUF weights stay quantized on the CPU (down to ~0.56 bytes a parameter for
            # Q4_0); unknown formats count at that floor: the check refuses only what cannot fit.
            sizes = replace(sizes, other_weight_bytes=int(cfg.num_params * 0.5625),
                            expert_bytes=0)
        plan_host(sizes, pinned_experts=False, num_tokens=c.num_tokens or min_tokens,
                  available=host_available_bytes(), on_cpu=True, extra=extra,
                  **state_rows(cfg, c))


def pin(tensor, total: int = 0):
    """A pinned copy of a host tensor; a failure names RLIMIT_MEMLOCK, the bytes needed (`total`:
    every expert) and the fix."""
    try:
        return tensor.pin_memory()
    except RuntimeError as exc:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else fmt_bytes(soft)
        size = tensor.numel() * tensor.element_size()
        raise MemoryPlanError(
            f"pinning the experts in host memory ({fmt_bytes(max(total, size))} in all) failed "
            f"at a {fmt_bytes(size)} tensor ({exc}); RLIMIT_MEMLOCK is {limit}: raise it with "
            f"`ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity; docker: --ulimit "
            f"memlock=-1), or pass --moe-cache-rate 1 to keep every expert on the GPU") from None


def moe_layers(model) -> list:
    """The MoE MLP blocks of a loaded Decoder, in layer order."""
    return [layer.mlp for layer in model.layers if hasattr(layer.mlp, "offload")]


def attach_expert_cache(model, decision: OffloadDecision):
    """Pin every MoE layer's host experts, build the cache and route the layers through it.
    GGUF experts stay in their blocks (expert_pool.BlockPool) where the decode kernels read
    every layer's types, FP8 or NVFP4 experts in their format (ScaledPool) where every layer
    shares one format and layout; other experts are floats (FloatPool)."""
    import torch

    from freetoken.engine.expert_cache import ExpertCache
    from freetoken.kernel import ops

    layers = moe_layers(model)
    device = model.arrays.torch_device
    scaled_format = in_scaled_format(layers)
    if not scaled_format and any(mlp.scaled is not None for mlp in layers):
        log.warning("offloaded experts become floats: the scaled expert pool takes one format "
                    "and layout of FP8 or NVFP4 experts in every MoE layer")
        _dequantize_scaled(layers, model.dtype)
    blocks = in_format(model, layers)
    if not blocks and any(mlp.qtypes for mlp in layers):
        log.warning("offloaded experts become floats: the GGUF expert decode does not take "
                    "this model's expert types or shapes")
        _dequantize_experts(layers, model.dtype)
    w13, w2 = _pin_experts(layers)
    slots = cache_slots(ModelSizes.of(model.config, model.dtype), decision.rate)
    cfg, policy = model.config, None
    if scaled_format:
        from freetoken.engine.expert_pool import ScaledPool
        from freetoken.models.forward.scaled_moe import ScaledKernels

        on_cpu = ScaledPool.computes_on_cpu_format(w13[0].format)
        pool = ScaledPool(w13, w2, cfg.moe.top_k, ScaledKernels.for_device(model.device),
                          ops.bind("moe_experts_scaled", "cpu") if on_cpu else None)
        if decision.cpu and not on_cpu:
            log.warning("--moe-cpu auto: every miss of these %s experts is copied (the CPU "
                        "computes FP8 experts only)", w13[0].format)
        policy = _kernel_co_execution(torch, device, pool, "FP8 experts") \
            if decision.cpu and on_cpu else None
    elif blocks:
        from freetoken.engine.expert_pool import BlockKernels, BlockPool

        pool = BlockPool(w13, w2, [mlp.qtypes for mlp in layers], cfg.hidden_size,
                         cfg.moe.intermediate_size, BlockKernels.for_device(model.device, device))
        policy = _kernel_co_execution(torch, device, pool, "GGUF blocks") if decision.cpu \
            else None
    else:
        from freetoken.engine.expert_pool import FloatPool

        pool = FloatPool(w13, w2, ops.bind("moe_experts", model.device))
        policy = _co_execution(torch, device, w13, w2) if decision.cpu else None
    cache = ExpertCache(pool, device, slots, policy)
    if decision.prefetch:
        from freetoken.engine.expert_prefetch import next_layer_routers

        cache.predictors = next_layer_routers(layers, cfg.moe.num_experts, cfg.moe.top_k)
    for index, mlp in enumerate(layers):
        mlp.offload = _LayerHook(cache, index)
    return cache


def _host_experts(mlp) -> tuple:
    """A MoE layer's host experts (w13, w2): stacked tensors, or FP8 ScaledWeights."""
    return mlp.scaled.weights if mlp.scaled is not None else (mlp.w13, mlp.w2)


def _tensors(weight) -> list:
    """The tensors of a host expert stack: itself, or a ScaledWeight's values and scales."""
    from freetoken.models.quant.scaled import ScaledWeight

    if not isinstance(weight, ScaledWeight):
        return [weight]
    return [t for t in (weight.data, weight.scales, weight.row_scale) if t is not None]


def _pinned(weight, total: int):
    """A pinned copy of a host expert stack (every tensor of a ScaledWeight)."""
    from freetoken.models.quant.scaled import ScaledWeight

    if not isinstance(weight, ScaledWeight):
        return pin(weight, total)
    rows = None if weight.row_scale is None else pin(weight.row_scale, total)
    return replace(weight, data=pin(weight.data, total), scales=pin(weight.scales, total),
                   row_scale=rows)


def _pin_experts(layers: list) -> tuple[list, list]:
    """Every MoE layer's host experts pinned (w13 and w2 per layer); the layers drop their
    unpinned ones, layer by layer, so the unpinned copy of one layer at a time is extra."""
    total = sum(t.numel() * t.element_size() for mlp in layers
                for weight in _host_experts(mlp) for t in _tensors(weight))
    w13, w2 = [], []
    for mlp in layers:
        a, b = _host_experts(mlp)
        w13.append(_pinned(a, total))
        w2.append(_pinned(b, total))
        mlp.w13 = mlp.w2 = mlp.scaled = None
    return w13, w2


def in_scaled_format(layers: list) -> bool:
    """Whether every MoE layer's experts are FP8 or NVFP4 the in-format pool takes (one format
    and layout)."""
    from freetoken.engine.expert_pool import ScaledPool

    if not layers or any(mlp.scaled is None for mlp in layers):
        return False
    w13, w2 = zip(*(mlp.scaled.weights for mlp in layers))
    return ScaledPool.takes(list(w13), list(w2))


def in_format(model, layers: list) -> bool:
    """Whether every MoE layer's experts are GGUF blocks the in-format pool's decode reads
    (moe_decode_quant's rule)."""
    from freetoken.models.forward import moe_decode_quant

    if not layers or not all(mlp.qtypes for mlp in layers):
        return False
    device = getattr(model.arrays, "device", None)
    return all(moe_decode_quant.eligible(model.config, mlp, model.dtype, device)
               for mlp in layers)


def _dequantize_experts(layers: list, dtype: str) -> None:
    """GGUF host experts as floats of `dtype` (the float pool's), layer by layer."""
    import torch

    from freetoken.kernel.reference import dequantize

    item = getattr(torch, dtype)
    for mlp in layers:
        q13, q2 = mlp.qtypes
        for name, qtype in (("w13", q13), ("w2", q2)):
            blocks = getattr(mlp, name)
            e, rows = blocks.shape[:2]
            floats = dequantize(blocks.reshape(e * rows, -1).cpu(), qtype)
            setattr(mlp, name, floats.reshape(e, rows, -1).to(item))
        mlp.qtypes = ()


def _dequantize_scaled(layers: list, dtype: str) -> None:
    """FP8 host experts as floats of `dtype` (the float pool's), layer by layer."""
    import torch

    from freetoken.models.quant.scaled import dequantize

    item = getattr(torch, dtype)
    for mlp in layers:
        if mlp.scaled is not None:
            mlp.w13, mlp.w2 = (dequantize(w).to(item) for w in mlp.scaled.weights)
            mlp.scaled = None


def _co_execution(torch, device, w13: list, w2: list):
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput, measure_cpu, \
        measure_h2d

    _, two_i, h = w13[0].shape
    cpu_bw, cpu_flops = measure_cpu(torch, h, two_i // 2, w13[0].dtype)
    throughput = Throughput(measure_h2d(torch, device), cpu_bw, cpu_flops)
    log.info("co-execution policy: %.1f GB/s H2D, CPU %.1f GB/s and %.1f GFLOP/s",
             throughput.h2d_bytes_per_s / 1e9, cpu_bw / 1e9, cpu_flops / 1e9)
    return CoExecPolicy(throughput, (w13[0][0].numel() + w2[0][0].numel())
                        * w13[0].element_size(), 6 * h * (two_i // 2))


def _kernel_co_execution(torch, device, pool, kind: str):
    """The co-execution policy over experts in their format (GGUF blocks, FP8): the CPU's
    experts kernel timed on the first MoE layer's host experts, the copies at the pinned H2D
    bandwidth, a mean expert's bytes."""
    from freetoken.engine.offload_policy import CoExecPolicy, Throughput, measure_cpu_kernel, \
        measure_h2d

    expert = pool.pinned_bytes // (pool.num_layers * pool.num_experts)
    cpu_bw, cpu_flops = measure_cpu_kernel(torch, pool.cpu_run(0), pool.hidden, pool.inter,
                                           expert)
    throughput = Throughput(measure_h2d(torch, device), cpu_bw, cpu_flops)
    log.info("co-execution policy over %s: %.1f GB/s H2D, CPU %.1f GB/s and %.1f GFLOP/s",
             kind, throughput.h2d_bytes_per_s / 1e9, cpu_bw / 1e9, cpu_flops / 1e9)
    return CoExecPolicy(throughput, expert, 6 * pool.hidden * pool.inter)


class _LayerHook:
    """MoEMLP.offload for one layer: the cache's run with the layer's index bound."""

    def __init__(self, cache, index: int):
        self.cache, self.index = cache, index

    @property
    def fuses_decode(self) -> bool:
        """Whether moe_decode_quant's decode step may hand its routed experts to this hook
        (a GGUF block pool runs them with its kernels, accumulating into the residual)."""
        return self.cache.fuses_decode

    def __call__(self, out, x, topk_ids, topk_weights, workspace, accumulate=False) -> None:
        if accumulate:
            self.cache.run(self.index, out, x, topk_ids, topk_weights, workspace, accumulate)
        else:
            self.cache.run(self.index, out, x, topk_ids, topk_weights, workspace)
