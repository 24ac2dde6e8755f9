"""Batch-1 decode speed with and without a grammar constraint, on the CPU with the embedded
SmolLM2-135M-Instruct.

Three runs of the same chat prompt, greedy, ignore_eos, N output tokens: no constraint; a JSON
Schema constraint (an object with one free string, so the model writes N tokens inside the
grammar) with its masks computed off the critical path as the engine does; and the same
constraint with every mask computed inline (what overlapping saves). Decode tok/s is measured
from the first to the last output token (prefill excluded); runs are interleaved, medians.

    python benchmarks/constrained_decode.py [--tokens 128] [--repeats 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import Future
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper as JSON."}]


class InlineExecutor:
    """Runs each mask computation at once on the caller's thread (on the critical path)."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future


def decode_rate(engine, prepared, params) -> float:
    async def run() -> list[float]:
        stamps = []
        stream = engine.submit(prepared.prompt_ids, params, guide=prepared.guide)
        async for out in stream:
            stamps.extend([time.perf_counter()] * len(out.token_ids))
        return stamps

    stamps = asyncio.run(run())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from freetoken.agent.request import AgentRequest, Constraint
    from freetoken.engine import guide as guide_module
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams
    from freetoken.models.loader import load_model
    from freetoken.server.agent import AgentSupport

    loaded = load_model(None, device="cpu")
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=2048, max_num_seqs=1,
                                                     device="cpu")).start()
    engine.warm_up()
    support = AgentSupport(loaded.tokenizer, loaded.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    plain = AgentRequest(messages=PROMPT)
    constrained = AgentRequest(messages=PROMPT, constraint=Constraint("json", schema=SCHEMA))
    overlapped_executor = guide_module.mask_executor()
    rates: dict[str, list[float]] = {"none": [], "json, mask overlapped": [],
                                     "json, mask inline": []}
    for _ in range(args.repeats + 1):   # the first round warms the grammar caches
        for label in rates:
            guide_module._executor = (InlineExecutor() if label.endswith("inline")
                                      else overlapped_executor)
            request = plain if label == "none" else constrained
            rates[label].append(decode_rate(engine, support.prepare(request, args.tokens),
                                            params))
    engine.shutdown()
    medians = {label: statistics.median(values[1:]) for label, values in rates.items()}
    base = medians["none"]
    lines = [f"SmolLM2-135M-Instruct Q4_1, CPU, batch 1, greedy, {args.tokens} tokens, "
             f"medians of {args.repeats}"]
    for label, rate in medians.items():
        lines.append(f"  {label:24s} {rate:7.1f} tok/s  ({(rate / base - 1) * 100:+.1f}% vs none)")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "constrained-decode-smollm2.log").write_text("\n".join(lines) + "\n")
        (args.out / "constrained-decode-smollm2.json").write_text(json.dumps(
            {"tokens": args.tokens, "repeats": args.repeats, "tok_per_s": medians,
             "all": rates}, indent=2) + "\n")


if __name__ == "__main__":
    main()
