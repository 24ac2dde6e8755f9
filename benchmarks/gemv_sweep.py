"""Every compiled decode_gemv variant, threads-per-row group and norm placement on the decode
projections of SmolLM2-135M, Qwen3-8B and Qwen3.6-35B-A3B (whose attention shapes are
Qwen3-30B-A3B's), on one GPU, with no rebuild between them.

    python benchmarks/gemv_sweep.py [--tokens 1,2,4,8] [--shapes qwen3-8b,smollm2,qwen3.6]
                                    [--json F]

Per (projection, T): each configuration's output is checked against the default's (variant 0,
fused_decode's rule for group and norm placement) to the f32 summation-order tolerance, then
timed as a CUDA graph of launches (events, median of 5 replays) whose weights cycle through
enough copies to stream more than the L2 cache holds, as a whole model's layers do. GB/s counts
every byte read and written, beside the device-to-device copy bandwidth of the same run. The
last lines are fused_decode.TUNED entries, ready to paste, for the configurations that beat
the rule by more than 2%.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402

# name: (projection, N output columns (I for swiglu), K)
SHAPES = {
    "smollm2 qkv": ("qkv", 960, 576), "smollm2 o": ("add", 576, 576),
    "smollm2 gate_up": ("swiglu", 1536, 576), "smollm2 down": ("add", 576, 1536),
    "qwen3-8b qkv": ("qkv", 6144, 4096), "qwen3-8b o": ("add", 4096, 4096),
    "qwen3-8b gate_up": ("swiglu", 12288, 4096), "qwen3-8b down": ("add", 4096, 12288),
    # Qwen3.6-35B-A3B: Gated DeltaNet in/out, gated attention's qkv and gate; its qkv and o
    # (= gdn out) are Qwen3-30B-A3B's too
    "qwen3.6 gdn_in": ("qkv", 12352, 2048), "qwen3.6 qkv": ("qkv", 5120, 2048),
    "qwen3.6 gate": ("qkv", 4096, 2048), "qwen3.6 o": ("add", 2048, 4096),
}
EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
DTYPE, NORM_EPS, MIN_LAUNCHES, WIN, DEVICE = torch.bfloat16, 1e-6, 20, 0.98, "cuda"


class Case:
    """One projection at T tokens: weight copies, inputs, and a call per configuration."""

    def __init__(self, projection: str, n: int, k: int, t: int, l2_bytes: int):
        self.projection, self.n, self.k, self.t = projection, n, k, t
        rows = 2 * n if projection == "swiglu" else n
        w_bytes = rows * k * DTYPE.itemsize
        copies = max(1, math.ceil(3 * l2_bytes / w_bytes))
        self.launches = max(MIN_LAUNCHES, copies)
        g = torch.Generator(device=DEVICE).manual_seed(n * k + t)
        w = torch.randn(rows, k, device=DEVICE, dtype=DTYPE, generator=g) / k ** 0.5
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        self.x = torch.randn(t, k, device=DEVICE, dtype=DTYPE, generator=g)
        self.norm = 1 + 0.1 * torch.randn(k, device=DEVICE, dtype=DTYPE, generator=g)
        self.xn = torch.empty_like(self.x)
        self.out = torch.randn(t, n, device=DEVICE, dtype=DTYPE, generator=g)
        self.residual = self.out.clone()  # the add's input, restored before each check
        act_bytes = (t * k + (2 if projection == "add" else 1) * t * n) * DTYPE.itemsize
        self.bytes = w_bytes + act_bytes

    def call(self, variant: int, group: int, prologue: bool, i: int = 0) -> None:
        from freetoken.kernel import ops

        w = self.weights[i % len(self.weights)]
        if self.projection == "add":
            ops.decode_gemv_add(self.out, self.x, w, group, variant)
            return
        x, norm = self.x, self.norm
        if not prologue:
            ops.rms_norm(self.xn, self.x, self.norm, NORM_EPS)
            x, norm = self.xn, None
        if self.projection == "qkv":
            ops.decode_gemv(self.out, x, w, None, norm, NORM_EPS, group, variant)
        else:
            ops.decode_gemv_swiglu(self.out, x, w, norm, NORM_EPS, group, variant)

    def result(self, config) -> torch.Tensor:
        self.out.copy_(self.residual)
        self.call(*config)
        return self.out.clone()

    def tolerance(self) -> torch.Tensor:
        """|a - b| allowed between two correct kernels: their f32 sums each lie within the
        order error of the exact dot product (32 f32 ulps of sum |x w|, times sqrt K); with the
        norm, a few elements of the normed x may round to their neighbour (4, one ulp each, as
        the inverse RMS sums in another order); two roundings of values that close to the dtype
        differ by at most one more ulp, at every place the chain rounds."""
        from freetoken.kernel import reference

        eps = EPS[DTYPE]
        xn = self.x.float()
        if self.projection != "add":
            xn = torch.empty_like(self.x)
            reference.rms_norm(xn, self.x, self.norm, NORM_EPS)
            xn = xn.float()
        w = self.weights[0].float()
        exact = xn @ w.T
        err = 2 * 32 * 2.0 ** -23 * math.sqrt(self.k) * (xn.abs() @ w.abs().T)
        if self.projection != "add":
            err += 4 * eps * xn.abs().max() * w.abs().max()
        if self.projection == "qkv":
            return err + eps * exact.abs()
        if self.projection == "add":
            return err + eps * exact.abs() + eps * (self.residual.float() + exact).abs()
        gate, up = exact[:, :self.n], exact[:, self.n:]
        dg = err[:, :self.n] + eps * gate.abs()
        du = err[:, self.n:] + eps * up.abs()
        silu = torch.nn.functional.silu(gate)
        return 1.1 * dg * up.abs() + silu.abs() * du + dg * du + eps * (silu * up).abs()

    def gpu_us(self, config) -> float:
        """Microseconds per launch: a graph of self.launches calls, median of 5 replays."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.call(*config)  # warm (and load the kernel) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for i in range(self.launches):
                    self.call(*config, i)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / self.launches)
        return sorted(times)[2]


def configs(case: Case):
    """(variant, group, norm in prologue) for every variant, every group that gives each thread
    at least one 16-byte vector per row and fits the block, both norm placements."""
    from freetoken.models.forward.fused_decode import _GROUPS, GEMV_VARIANTS

    placements = (True,) if case.projection == "add" else (True, False)
    for variant, knobs in enumerate(GEMV_VARIANTS):
        for group in _GROUPS:
            if group <= knobs.threads and case.k // 8 >= group:
                for prologue in placements:
                    yield variant, group, prologue


def rule(case: Case, sms: int):
    from freetoken.models.forward import fused_decode as fd

    prologue = case.projection == "add" or case.t <= fd.NORM_IN_PROLOGUE_TOKENS
    return 0, fd.gemv_group(case.n, case.k, sms), prologue


def sweep(name: str, case: Case, sms: int, bandwidth: float) -> dict:
    base = rule(case, sms)
    want, limit = case.result(base), case.tolerance()
    rows = []
    for config in configs(case):
        excess = ((case.result(config).float() - want.float()).abs() - limit).max().item()
        us = case.gpu_us(config)
        rows.append(dict(config=config, us=us, ok=excess <= 0, excess=excess,
                         gbs=case.bytes / us / 1e3))
    default = next(r for r in rows if r["config"] == base)
    for variant in sorted({r["config"][0] for r in rows}):
        mine = [r for r in rows if r["config"][0] == variant]
        best = min(mine, key=lambda r: (not r["ok"], r["us"]))
        bad = sum(not r["ok"] for r in mine)
        v, group, prologue = best["config"]
        print(f"{name:17}{case.t:3}{v:4}{group:6}{'pro' if prologue else 'sep':>5}"
              f"{best['us']:9.2f}{best['gbs']:9.0f}{100 * best['gbs'] * 1e9 / bandwidth:7.0f}%"
              f"{default['us'] / best['us']:8.2f}x" + (f"  {bad} FAILED the check"
                                                        if bad else ""), flush=True)
    return dict(name=name, t=case.t, default=default, rows=rows,
                best=min((r for r in rows if r["ok"]), key=lambda r: r["us"]))


def tuned_lines(results: list[dict]) -> list[str]:
    from freetoken.models.forward.fused_decode import MAX_TOKENS

    lines = []
    for res in results:
        best, default = res["best"], res["default"]
        if res["t"] > MAX_TOKENS or best["us"] > WIN * default["us"]:
            continue
        projection, n, k = SHAPES[res["name"]]
        v, group, prologue = best["config"]
        norm = "" if projection == "add" else f", norm_prologue={prologue}"
        lines.append(f"    ({projection!r}, {n}, {k}, {res['t']}): GemvChoice({v}, {group}{norm}),"
                     f"  # {res['name']}: {default['us']:.1f} -> {best['us']:.1f} us")
    return lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--shapes", default="qwen3-8b,smollm2", help="model prefixes of SHAPES")
    p.add_argument("--json", help="write every configuration's time here")
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    bandwidth, sms = d2d_bandwidth(), props.multi_processor_count
    print(f"{props.name}: D2D copy bandwidth {bandwidth / 1e9:.0f} GB/s (read+write), {sms} SMs, "
          f"L2 {props.L2_cache_size >> 20} MiB")
    print(f"{'projection':17}{'T':>3}{'var':>4}{'group':>6}{'norm':>5}{'us':>9}{'GB/s':>9}"
          f"{'%D2D':>8}{'vs v0':>9}   (each variant at its best group / norm placement)")
    prefixes = tuple(args.shapes.split(","))
    results = []
    for name, (projection, n, k) in SHAPES.items():
        if not name.startswith(prefixes):
            continue
        for t in (int(v) for v in args.tokens.split(",")):
            case = Case(projection, n, k, t, props.L2_cache_size)
            results.append(sweep(name, case, sms, bandwidth))
            del case
            torch.cuda.empty_cache()
    print("\n# fused_decode.TUNED, measured on " + props.name)
    print("TUNED: dict[tuple[str, int, int, int], GemvChoice] = {")
    print("\n".join(tuned_lines(results)))
    print("}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(bandwidth=bandwidth, results=results)))


if __name__ == "__main__":
    main()
