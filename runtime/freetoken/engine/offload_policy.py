"""Which missed experts to copy to the GPU and which to compute on the CPU, per MoE layer step,
and the CPU side itself: float experts through torch, GGUF and FP8 experts through the CPU
engine's own experts kernels (moe_experts_quant, moe_experts_scaled) over the same host bytes
the cache copies.

A copied expert costs its bytes over PCIe whatever the number of tokens routed to it (and stays
cached for later steps); an expert computed on the CPU costs reading its weights from host RAM
plus its FLOPs for each routed token. The two run at the same time (copies on their own stream,
CPU experts on the host thread), so the step waits for the slower side: the policy hands the
CPU the experts with the fewest tokens for as long as the CPU side stays shorter than what is
left to copy (a greedy makespan balance).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Throughput:
    """Measured at start: pinned host-to-device bytes/s, host-RAM bytes/s one CPU expert
    streams, and CPU FLOP/s of the expert matmuls."""

    h2d_bytes_per_s: float
    cpu_bytes_per_s: float
    cpu_flops: float


@dataclass(frozen=True)
class CoExecPolicy:
    """Splits a layer's missed experts into (copy, cpu). enabled=False copies every miss."""

    throughput: Throughput
    expert_bytes: int
    flops_per_token: int     # 2 * 3 * H * I: gate, up and down of one token through one expert
    enabled: bool = True

    def copy_seconds(self) -> float:
        return self.expert_bytes / self.throughput.h2d_bytes_per_s

    def cpu_seconds(self, tokens: int) -> float:
        t = self.throughput
        return self.expert_bytes / t.cpu_bytes_per_s + tokens * self.flops_per_token / t.cpu_flops

    def split(self, misses: dict[int, int]) -> tuple[list[int], list[int]]:
        """misses: expert id -> tokens routed to it this step. Returns (copy ids, cpu ids),
        each in ascending id order."""
        if not self.enabled or not misses:
            return sorted(misses), []
        per_copy = self.copy_seconds()
        copy_left = per_copy * len(misses)
        cpu_total, cpu = 0.0, []
        for expert in sorted(misses, key=lambda e: (misses[e], e)):
            cost = self.cpu_seconds(misses[expert])
            if cpu_total + cost > copy_left - per_copy:   # the CPU would finish last
                break
            cpu.append(expert)
            cpu_total += cost
            copy_left -= per_copy
        chosen = set(cpu)
        return sorted(e for e in misses if e not in chosen), sorted(cpu)


def measure_h2d(torch, device, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Pinned host-to-device bytes/s (best of `repeats` copies of `nbytes`)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_cpu(torch, hidden: int, inter: int, dtype, repeats: int = 3) -> tuple[float, float]:
    """(bytes/s, FLOP/s) of one expert's SwiGLU on the CPU through torch, at 1 and 16 tokens:
    one token is bound by reading the weights, many tokens by the FLOPs."""
    w13 = torch.randn(2 * inter, hidden).to(dtype)
    w2 = torch.randn(hidden, inter).to(dtype)

    def run(tokens: int) -> float:
        x = torch.randn(tokens, hidden).to(dtype)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            gu = x @ w13.T
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            _ = act @ w2.T
            best = min(best, time.perf_counter() - start)
        return best

    nbytes = (w13.numel() + w2.numel()) * w13.element_size()
    one, many = run(1), run(16)
    flops = 2 * 3 * hidden * inter
    return nbytes / one, max(15 * flops / max(many - one, 1e-9), flops / one)


def cpu_experts(x, w13, w2, ids, weights, experts: list[int]):
    """sum over the (t, k) routed to `experts` of weights[t, k] * expert(x[t]), in float32 on
    the CPU through torch (bf16 host weights are multiplied as they are: no per-call
    conversion copy). x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids int [T, K], weights [T, K]."""
    import torch

    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in experts:
        rows, ks = (ids == e).nonzero(as_tuple=True)
        xe = x[rows].to(w13.dtype)
        gu = (xe @ w13[e].T).float()
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = (act.to(w2.dtype) @ w2[e].T).float()
        out.index_add_(0, rows, y * weights[rows, ks].float()[:, None])
    return out


def cpu_kernel_experts(x, ids, weights, experts: list[int], run):
    """cpu_experts through one of the CPU engine's experts kernels: the pairs routed to
    `experts`, each as its own row, through `run(out, xs, ids, weights, expert_map)` (the
    kernel over one layer's host experts; it groups rows by expert, so each expert's bytes
    are read once), summed into float32 [T, H] per token."""
    import torch

    chosen = torch.tensor(experts, dtype=ids.dtype)
    rows, ks = torch.isin(ids, chosen).nonzero(as_tuple=True)
    out = torch.zeros(x.shape, dtype=torch.float32)
    if rows.numel() == 0:
        return out
    xs = x[rows].float().contiguous()
    part = torch.empty_like(xs)
    run(part, xs, ids[rows, ks].to(torch.int32).view(-1, 1).contiguous(),
        weights[rows, ks].float().view(-1, 1).contiguous())
    out.index_add_(0, rows, part)
    return out


def block_runner(w13, w2, qtype13: int, qtype2: int, kernel):
    """cpu_kernel_experts' run over GGUF blocks: `kernel` (ops.moe_experts_quant on the CPU)
    over w13 uint8 [E, 2I, pitch] and w2 uint8 [E, H, pitch] (rows as the GPU keeps them: the
    kernel reads the padded pitch)."""
    import torch

    identity = torch.arange(w13.shape[0], dtype=torch.int32)
    none = torch.empty(0, dtype=torch.uint8)
    return lambda out, xs, ids, weights: kernel(out, xs, w13, w2, qtype13, qtype2, ids,
                                                weights, identity, none)


def scaled_runner(w13, w2, kernel):
    """cpu_kernel_experts' run over FP8 experts: `kernel` (ops.moe_experts_scaled on the CPU)
    over one layer's host ScaledWeights w13 [E, 2I, H] and w2 [E, H, I] (e4m3 codes, float32
    grids, row scales or none)."""
    import torch

    from freetoken.models.forward.scaled_linear import host_operands

    parts = host_operands(w13) + host_operands(w2)
    identity = torch.arange(w13.shape[0], dtype=torch.int32)
    none = torch.empty(0, dtype=torch.uint8)
    return lambda out, xs, ids, weights: kernel(out, xs, *parts, 0, *w13.block, *w2.block, ids,
                                                weights, identity, none)


def measure_cpu_kernel(torch, run, hidden: int, inter: int, expert_bytes: int,
                       repeats: int = 3) -> tuple[float, float]:
    """(bytes/s, FLOP/s) of one expert on the CPU through a cpu_kernel_experts `run`, at 1 and
    16 tokens, as measure_cpu does for torch (`expert_bytes`: one expert's bytes as stored)."""
    def timed(tokens: int) -> float:
        x = torch.randn(tokens, hidden)
        ids = torch.zeros(tokens, 1, dtype=torch.int32)
        weights = torch.ones(tokens, 1)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            cpu_kernel_experts(x, ids, weights, [0], run)
            best = min(best, time.perf_counter() - start)
        return best

    one, many = timed(1), timed(16)
    flops = 2 * 3 * hidden * inter
    return expert_bytes / one, max(15 * flops / max(many - one, 1e-9), flops / one)
