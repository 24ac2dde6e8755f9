"""Where one CPU decode step's time goes: every kernel the forward calls and every projection,
timed per call over batch-1 decode steps of a GGUF model, beside the whole step.

    python benchmarks/cpu_decode_profile.py [MODEL.gguf] [--steps 40] [--context 42]

MODEL defaults to the embedded SmolLM2. Each projection is reported with its GGUF type, bytes
and the rate its bytes stream at (GB/s), so a projection that is compute-bound (far below the
LM head's rate, which streams from DRAM) stands out. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.models.helpers import PagedRunner  # noqa: E402

TIMES: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()
BYTES: dict[str, int] = collections.defaultdict(int)     # summed over the instances
INSTANCES: collections.Counter = collections.Counter()


def timed(name: str, fn, nbytes: int = 0):
    def call(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        TIMES[name] += time.perf_counter() - start
        CALLS[name] += 1
        return result
    BYTES[name] += nbytes
    INSTANCES[name] += 1
    return call


def weight_bytes(linear) -> int:
    """Bytes of a projection's weights (GGUF blocks are tvm-ffi tensors: read via DLPack)."""
    total = 0
    for part in getattr(linear, "parts", [linear]):
        data = getattr(part, "data", None)
        total += (np.from_dlpack(data).nbytes if data is not None
                  else np.asarray(part.weight_t).nbytes)
    return total


def label(prefix: str, linear) -> str:
    parts = getattr(linear, "parts", [linear])
    return f"{prefix} [{'+'.join(str(getattr(p, 'qtype', 'f32')) for p in parts)}]"


def instrument(model) -> None:
    kernels = model._k
    for name, fn in list(vars(kernels).items()):
        if callable(fn) and name != "arg":
            setattr(kernels, name, timed(name, fn))
    for layer in model.layers:
        for owner in (layer.attn, layer.mlp):
            for attr, value in list(vars(owner).items()):
                if hasattr(value, "out_features") and callable(value):
                    setattr(owner, attr, timed(label(attr, value), value, weight_bytes(value)))
        if getattr(layer.mlp, "experts_quant", None) is not None:   # bound at load: wrap it here
            layer.mlp.experts_quant = timed("routed experts", layer.mlp.experts_quant)
    model._lm_head = timed(label("lm_head", model._lm_head), model._lm_head,
                           weight_bytes(model._lm_head))


def main() -> None:
    from freetoken.models.loader import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--context", type=int, default=42)
    args = p.parse_args()
    model = load_model(args.model, device="cpu").model
    instrument(model)
    runner = PagedRunner(model, num_blocks=64, block_size=16)
    token = int(np.asarray(runner.step([(0, list(range(100, 100 + args.context)))])[0]).argmax())
    for _ in range(5):
        token = int(np.asarray(runner.step([(0, [token])])[0]).argmax())
    TIMES.clear()
    CALLS.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        token = int(np.asarray(runner.step([(0, [token])])[0]).argmax())
    step = (time.perf_counter() - start) / args.steps
    print(f"decode step {1e3 * step:.2f} ms ({1 / step:.1f} tok/s); timed calls "
          f"{1e3 * sum(TIMES.values()) / args.steps:.2f} ms")
    print(f"{'call':34}{'calls':>6}{'ms/step':>9}{'us/call':>9}{'GB/s':>7}")
    for name, total in sorted(TIMES.items(), key=lambda kv: -kv[1]):
        per_call = total / CALLS[name]
        calls = CALLS[name] / args.steps
        rate = BYTES[name] / INSTANCES[name] / per_call / 1e9 if BYTES[name] else None
        print(f"{name:34}{calls:6.0f}{1e3 * total / args.steps:9.3f}{1e6 * per_call:9.1f}"
              + (f"{rate:7.1f}" if rate else ""))


if __name__ == "__main__":
    main()
