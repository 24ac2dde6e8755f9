"""Host time of the engine's decode loop, without the model: everything a step costs besides
the forward (scheduling, batch preparation, sampling, detokenizing, streaming).

    python benchmarks/engine_host.py [--batch 1,8,32] [--tokens 256] [--context 1024] [--profile]
        [--overlap on,off] [--device cuda --forward-us 500]

The model is a stand-in that returns fixed float32 logits at once, so what is measured is
device-independent Python work; on a GPU it adds to the graph replay's time unless it
overlaps it. Prints, per batch size, the wall time per generated token (engine and
event-loop threads together, as a server runs them) and the engine thread's CPU time per
step (scheduling, batch preparation, sampling, bookkeeping, streaming); --profile adds where
the engine thread's time goes (cProfile).

--overlap on runs the engine's overlap scheduling (engine/overlap.py; on the CPU it is forced,
and runs synchronously: it shows what its bookkeeping costs). --device cuda puts the stand-in on
the GPU, where its forward is a kernel that spins for --forward-us microseconds and sampling
runs on the device: a step then takes about forward + host time with overlap off, and about
max(forward, host time) with it on.
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
    """Shape of a small model; forward returns fixed random logits (on the GPU after a kernel
    that spins for `forward_us`)."""

    def __init__(self, device: str = "cpu", forward_us: float = 0.0):
        self.config = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64,
                                  intermediate_size=128, num_layers=1, num_heads=4,
                                  num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                  rope_theta=1e4, max_position=8192)
        self.arrays, self.dtype = HostArrays(), "float32"
        self._logits = np.random.default_rng(0).standard_normal((64, VOCAB)).astype(np.float32)
        self._cycles = 0
        if device != "cpu":
            import torch

            from freetoken.arrays import TorchArrays, parse_device

            self.arrays = TorchArrays(parse_device(device))
            self._logits = torch.from_numpy(self._logits).to(self.arrays.torch_device)
            self._cycles = int(forward_us * _sleep_cycles_per_us())
        self.device = self.arrays.device

    def forward(self, batch, kv):
        if self._cycles:
            import torch

            torch.cuda._sleep(self._cycles)
        return self._logits[:batch.num_seqs]


def _sleep_cycles_per_us() -> float:
    """GPU clock cycles of torch.cuda._sleep per microsecond, timed with CUDA events."""
    import torch

    cycles, start, end = 10_000_000, torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda._sleep(cycles)     # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


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


def measure(batch: int, tokens: int, context: int, temperature: float, overlap: bool = False,
            device: str = "cpu", forward_us: float = 0.0):
    """(wall seconds, steps, engine-thread CPU seconds) of `batch` concurrent requests of
    `context` prompt tokens decoding `tokens` each; prefill runs in a first, untimed round."""
    engine = Engine(StubModel(device, forward_us), StubTokenizer(),
                    EngineConfig(device=device, max_num_seqs=batch,
                                 num_tokens=2 * batch * (context + tokens + 64),
                                 max_prefill_tokens=batch * context, cuda_graphs=False,
                                 overlap=overlap))
    engine.overlap = overlap     # forced on the CPU (off there by default)
    engine.start()
    asyncio.run(_run(engine, batch, 4, context, temperature))
    steps0, cpu0 = engine.stats()["steps"], _thread_cpu(engine)
    start = time.perf_counter()
    asyncio.run(_run(engine, batch, tokens, context, temperature))
    elapsed = time.perf_counter() - start
    steps, cpu = engine.stats()["steps"] - steps0, _thread_cpu(engine) - cpu0
    engine.shutdown()
    return elapsed, steps, cpu


_STEP_CPU = [0.0]


_DEPTH = [0]


def _timed_steps() -> None:
    """Wrap Engine._next_step (scheduling, batch preparation), Engine._step (forward,
    sampling, bookkeeping, streaming) and the overlap loop's _launch and _advance to add up the
    engine thread's CPU time in them (thread_time: this thread only, not its waits for work,
    the lock or the GIL; a call inside another wrapped one is counted once)."""
    for name in ("_next_step", "_step", "_launch", "_advance"):
        original = getattr(Engine, name)

        def timed(self, *args, _original=original, **kwargs):
            t0 = time.thread_time()
            _DEPTH[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                _DEPTH[0] -= 1
                if not _DEPTH[0]:
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
    ap.add_argument("--overlap", default="off", help="off, on, or on,off (both)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--forward-us", type=float, default=500.0,
                    help="GPU: microseconds the stand-in forward keeps the GPU busy")
    args = ap.parse_args()
    _timed_steps()
    if args.profile:
        _profile_engine_thread()
    for mode in args.overlap.split(","):
        for b in (int(x) for x in args.batch.split(",")):
            elapsed, steps, cpu = measure(b, args.tokens, args.context, args.temperature,
                                          mode == "on", args.device, args.forward_us)
            print(f"overlap {mode:3s} batch {b:3d}: {steps} steps, wall "
                  f"{1e6 * elapsed / steps:7.1f} us/step "
                  f"{1e6 * elapsed / (b * args.tokens):7.1f} us/token, "
                  f"engine thread CPU {1e6 * cpu / steps:7.1f} us/step", flush=True)
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
