"""Host time of the engine's decode loop, without the model: everything a step costs besides
the forward (scheduling, batch preparation, sampling, detokenizing, streaming).

    python benchmarks/engine_host.py [--batch 1,8,32] [--tokens 256] [--context 1024] [--profile]

The model is a stand-in that returns fixed float32 logits at once, so what is measured is
device-independent Python work; on a GPU it adds to the graph replay's time unless it
overlaps it. Prints, per batch size, the wall time per generated token (engine and
event-loop threads together, as a server runs them) and the engine thread's CPU time per
step (scheduling, batch preparation, sampling, bookkeeping, streaming); --profile adds where
the engine thread's time goes (cProfile).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))

from freetoken.arrays import HostArrays  # noqa: E402
from freetoken.engine.config import EngineConfig  # noqa: E402
from freetoken.engine.engine import Engine  # noqa: E402
from freetoken.engine.request import SamplingParams  # noqa: E402
from freetoken.models.config import ModelConfig  # noqa: E402

VOCAB = 32000


class StubModel:
    """Shape of a small model; forward returns logits that favour token 7 + row."""

    def __init__(self):
        self.config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64,
                                  intermediate_size=128, num_layers=1, num_heads=4,
                                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                  rope_theta=1e4, max_position=8192)
        self.arrays, self.dtype, self.device = HostArrays(), "float32", HostArrays().device
        self._logits = np.random.default_rng(0).standard_normal((64, VOCAB)).astype(np.float32)

    def forward(self, batch, kv):
        return self._logits[:batch.num_seqs]


class StubTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


async def _run(engine: Engine, batch: int, tokens: int, context: int, temperature: float):
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True)
    prompt = [int(t) for t in np.arange(context) % 1000 + 10]

    async def one(i):
        async for _ in engine.generate(prompt[:-1] + [i + 1], params):
            pass
    await asyncio.gather(*(one(i) for i in range(batch)))


def measure(batch: int, tokens: int, context: int, temperature: float):
    """(wall seconds, steps, engine-thread CPU seconds) of `batch` concurrent requests of
    `context` prompt tokens decoding `tokens` each; prefill runs in a first, untimed round."""
    engine = Engine(StubModel(), StubTokenizer(),
                    EngineConfig(device="cpu", max_num_seqs=batch,
                                 num_tokens=2 * batch * (context + tokens + 64),
                                 max_prefill_tokens=batch * context)).start()
    asyncio.run(_run(engine, batch, 4, context, temperature))
    steps0, cpu0 = engine.stats()["steps"], _thread_cpu(engine)
    start = time.perf_counter()
    asyncio.run(_run(engine, batch, tokens, context, temperature))
    elapsed = time.perf_counter() - start
    steps, cpu = engine.stats()["steps"] - steps0, _thread_cpu(engine) - cpu0
    engine.shutdown()
    return elapsed, steps, cpu


_STEP_CPU = [0.0]


def _timed_steps() -> None:
    """Wrap Engine._next_step (scheduling, batch preparation) and Engine._step (forward,
    sampling, bookkeeping, streaming) to add up the engine thread's CPU time in them
    (thread_time: this thread only, not its waits for work, the lock or the GIL)."""
    for name in ("_next_step", "_step"):
        original = getattr(Engine, name)

        def timed(self, *args, _original=original):
            t0 = time.thread_time()
            try:
                return _original(self, *args)
            finally:
                _STEP_CPU[0] += time.thread_time() - t0
        setattr(Engine, name, timed)


def _thread_cpu(engine: Engine) -> float:
    return _STEP_CPU[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    _timed_steps()
    if args.profile:
        _profile_engine_thread()
    for b in (int(x) for x in args.batch.split(",")):
        elapsed, steps, cpu = measure(b, args.tokens, args.context, args.temperature)
        print(f"batch {b:3d}: {steps} steps, wall {1e6 * elapsed / (b * args.tokens):7.1f} "
              f"us/token, engine thread CPU {1e6 * cpu / steps:7.1f} us/step")
    if args.profile:
        _report()


_PROFILES: list[cProfile.Profile] = []


def _profile_engine_thread() -> None:
    """Wrap Engine._run so the engine thread runs under cProfile."""
    original = Engine._run

    def run(self):
        prof = cProfile.Profile()
        _PROFILES.append(prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()
    Engine._run = run


def _report() -> None:
    stats = pstats.Stats(_PROFILES[0])
    for p in _PROFILES[1:]:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
