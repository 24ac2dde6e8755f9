"""One MoE layer's decode step, the general path against the small-step kernels
(models/forward/moe_decode.py), per model shape and token count, on one GPU: GPU time per layer
(CUDA graph replay, CUDA events, median) and the bytes the step must read over that time, beside
the D2D copy bandwidth measured in the same run.

    python benchmarks/moe_decode_kernels.py [--tokens 1,2,4,8] [--layers 4] [--reps 30]

Under each row of up to 2 tokens (the steps the path takes), the new path's kernels one by one
(each alone in its graph): rms_norm, router GEMV, top-k, then gate/up and down for every launch
shape (moe_decode_kernels.cuh kVariants), each variant first checked against the torch
reference of tests/kernel/moe_decode_ref.py (a variant off it prints FAIL and no time); last,
gate/up + down of each variant together in one graph (the gap between them included).

Both paths start from the post-attention residual and end with the MLP output added to it:
  old  rms_norm, router mm (cuBLAS), moe_topk_softmax, moe_experts (align, gate/up, down),
       [shared expert: mm, silu_and_mul, mm, gate mm, sigmoid * add], residual add
  new  rms_norm, decode_gemv router, moe_topk_softmax, moe_decode_gate_up, moe_decode_down
Each graph runs `--layers` layers with their own weights, so one layer's bytes are not in L2
for the next. Bytes: the router, every distinct routed expert (gate, up, down) and the shared
expert, counted from the ids the run routed to. Random bf16 weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth, replay_ms  # noqa: E402

# name: (hidden, experts, inter, top_k, shared inter, shared gate)
SHAPES = {
    "Qwen3-30B-A3B": (2048, 128, 768, 8, 0, False),
    "Qwen3.6-35B-A3B": (2048, 256, 512, 8, 512, True),
}
BF = torch.bfloat16


class Layer:
    """One MoE layer's weights and its two decode paths over shared buffers."""

    def __init__(self, shape, sms: int, seed: int):
        from freetoken.models.forward.moe_decode import router_group

        h, e, i, k, si, gated = shape
        g = torch.Generator(device="cuda").manual_seed(seed)

        def rnd(*size):
            return torch.randn(*size, generator=g, device="cuda", dtype=BF) / size[-1] ** 0.5
        self.h, self.e, self.i, self.k, self.si = h, e, i, k, si
        self.router, self.w13, self.w2 = rnd(e, h), rnd(e, 2 * i, h), rnd(e, h, i)
        self.norm = torch.ones(h, device="cuda", dtype=BF)
        self.sh = (rnd(2 * si, h), rnd(h, si), rnd(1, h) if gated else None) if si else None
        self.emap = torch.arange(e, device="cuda", dtype=torch.int32)
        self.group = router_group(e, h, sms)

    def bytes_read(self, ids: torch.Tensor) -> int:
        experts = len(set(ids.flatten().tolist()))
        total = self.e * self.h + experts * 3 * self.h * self.i
        if self.sh is not None:
            total += 3 * self.h * self.si + (self.h if self.sh[2] is not None else 0)
        return 2 * total


class Buffers:
    def __init__(self, shape, t: int):
        from freetoken.kernel.ops import moe_workspace_bytes

        h, e, i, k, si, _ = shape
        z = lambda *s, dt=BF: torch.zeros(*s, device="cuda", dtype=dt)  # noqa: E731
        self.residual, self.hidden, self.out = z(t, h), z(t, h), z(t, h)
        self.logits, self.ids = z(t, e), z(t, k, dt=torch.int32)
        self.weights = z(t, k, dt=torch.float32)
        self.ws = z(moe_workspace_bytes(t, k, e, i, "bfloat16"), dt=torch.uint8)
        si = max(si, 8)
        self.sh_gu, self.sh_act = z(t, 2 * si), z(t, si)
        self.sh_out, self.sh_gate = z(t, h), z(t, 1)


def old_step(ly: Layer, b: Buffers) -> None:
    from freetoken.kernel import ops

    ops.rms_norm(b.hidden, b.residual, ly.norm, 1e-6)
    torch.mm(b.hidden, ly.router.T, out=b.logits)
    ops.moe_topk_softmax(b.weights, b.ids, b.logits, True)
    ops.moe_experts(b.out, b.hidden, ly.w13, ly.w2, b.ids, b.weights, ly.emap, b.ws)
    if ly.sh is not None:
        sw13, sw2, gw = ly.sh
        torch.mm(b.hidden, sw13.T, out=b.sh_gu)
        ops.silu_and_mul(b.sh_act, b.sh_gu)
        torch.mm(b.sh_act, sw2.T, out=b.sh_out)
        torch.mm(b.hidden, gw.T, out=b.sh_gate)
        b.out.addcmul_(b.sh_gate.sigmoid_(), b.sh_out)
    b.residual.add_(b.out)


def norm(ly: Layer, b: Buffers) -> None:
    from freetoken.kernel import ops

    ops.rms_norm(b.hidden, b.residual, ly.norm, 1e-6)


def router(ly: Layer, b: Buffers) -> None:
    from freetoken.kernel import ops

    ops.decode_gemv(b.logits, b.hidden, ly.router, None, None, 0.0, ly.group)


def topk(ly: Layer, b: Buffers) -> None:
    from freetoken.kernel import ops

    ops.moe_topk_softmax(b.weights, b.ids, b.logits, True)


def _shared(ly: Layer, b: Buffers):
    sw13, sw2, gw = ly.sh if ly.sh is not None else (None, None, None)
    act = b.sh_act if ly.sh is not None else None
    return sw13, sw2, gw, act, b.sh_gate if gw is not None else None


def gate_up(ly: Layer, b: Buffers, variant: int = 0) -> None:
    from freetoken.kernel import ops

    sw13, _, gw, act, gate = _shared(ly, b)
    ops.moe_decode_gate_up(b.hidden, ly.w13, ly.w2, b.ids, ly.emap, b.ws, sw13, act, gw, gate,
                           variant)


def down(ly: Layer, b: Buffers, variant: int = 0, out=None) -> None:
    from freetoken.kernel import ops

    _, sw2, _, act, gate = _shared(ly, b)
    ops.moe_decode_down(b.residual if out is None else out, ly.w13, ly.w2, b.ids, b.weights,
                        ly.emap, b.ws, sw2, act, gate, out is None, variant)


def new_step(ly: Layer, b: Buffers, variant: int = 0) -> None:
    norm(ly, b)
    router(ly, b)
    topk(ly, b)
    gate_up(ly, b, variant)
    down(ly, b, variant)


def graph_ms(step, layers, bufs, reps: int) -> float:
    """Median GPU time of one replay of a graph running `step` over every layer, per layer."""
    def run():
        for ly in layers:
            step(ly, bufs)
    run()  # loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    return replay_ms(graph, reps) / len(layers)


def variant_ok(ly: Layer, b: Buffers, variant: int) -> bool:
    """The variant's MLP output for the routing in `b` against the torch reference."""
    from tests.kernel.moe_decode_ref import reference_decode

    from freetoken.models.forward.moe_decode import VARIANTS

    out = torch.empty_like(b.out)
    gate_up(ly, b, variant)
    down(ly, b, variant, out)
    ref, bound = reference_decode(b.hidden, ly.w13, ly.w2, b.ids, b.weights, ly.emap, ly.sh)
    return bool(((out.float() - ref).abs() <= bound).all())


def breakdown(layers, bufs, reps: int) -> str:
    """Per-kernel GPU time of the new path (us per layer), every gate/up and down variant."""
    from freetoken.models.forward.moe_decode import VARIANTS

    new_step(layers[-1], bufs)          # the routing and activations the kernels read
    parts = [f"{f.__name__} {graph_ms(f, layers, bufs, reps) * 1e3:.1f}"
             for f in (norm, router, topk)]
    for kernel in (gate_up, down):
        times = []
        for v in range(VARIANTS):
            if not variant_ok(layers[-1], bufs, v):
                times.append(f"v{v} FAIL")
                continue
            step = lambda ly, b, _v=v, _k=kernel: _k(ly, b, _v)  # noqa: E731
            times.append(f"v{v} {graph_ms(step, layers, bufs, reps) * 1e3:.1f}")
        parts.append(f"{kernel.__name__} " + " / ".join(times))
    # gate/up then down of one variant in the same graph: what a decode step runs, with the gap
    # between the two (which a programmatic-dependent down overlaps) included
    pairs = []
    for v in range(VARIANTS):
        step = lambda ly, b, _v=v: (gate_up(ly, b, _v), down(ly, b, _v))  # noqa: E731
        pairs.append(f"v{v} {graph_ms(step, layers, bufs, reps) * 1e3:.1f}")
    parts.append("gate_up+down " + " / ".join(pairs))
    return "    us per layer: " + ", ".join(parts)


def row(name, shape, t, args, sms, bw) -> str:
    layers = [Layer(shape, sms, seed) for seed in range(args.layers)]
    bufs = Buffers(shape, t)
    bufs.residual.copy_(torch.randn(t, shape[0], device="cuda", dtype=BF))
    old = graph_ms(old_step, layers, bufs, args.reps)
    new = graph_ms(new_step, layers, bufs, args.reps)
    step_bytes = layers[-1].bytes_read(bufs.ids)  # the last layer's routing of the last replay
    old_bw, new_bw = step_bytes / old / 1e6, step_bytes / new / 1e6
    line = (f"{name:<16} {t:>2} {old * 1e3:>9.1f} {new * 1e3:>9.1f} {old / new:>6.2f}x "
            f"{step_bytes / 1e6:>8.1f} {old_bw:>8.0f} {new_bw:>8.0f} {100 * new_bw / bw:>6.1f}%")
    if t <= 2:
        line += "\n" + breakdown(layers, bufs, args.reps)
    del layers
    torch.cuda.empty_cache()
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = d2d_bandwidth() / 1e9
    print(f"{torch.cuda.get_device_name(0)}: D2D copy {bw:.0f} GB/s (read + write)")
    print(f"{'shape':<16} {'T':>2} {'old us':>9} {'new us':>9} {'speed':>7} {'MB read':>8} "
          f"{'old GB/s':>8} {'new GB/s':>8} {'of D2D':>7}")
    for name in args.shapes.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            print(row(name, SHAPES[name], t, args, sms, bw), flush=True)


if __name__ == "__main__":
    main()
