"""`ft bench`: prefill tok/s, time to first token and decode tok/s per batch size, via the engine."""

from __future__ import annotations

import asyncio
import json
import time

import click


async def _one(engine, prompt: list[int], max_tokens: int, first_token: list[float]) -> int:
    from freetoken.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    count = 0
    async for out in engine.generate(prompt, params):
        if count == 0 and out.token_ids:
            first_token.append(time.perf_counter())
        count += len(out.token_ids)
        if out.finish_reason == "error":
            raise click.ClickException(f"benchmark request failed: {out.error}")
    return count


async def _batch(engine, batch: int, prompt_len: int, gen_len: int, vocab: int) -> dict:
    """B concurrent requests; decode rate counts tokens after every request has its first."""
    prompts = [[(7 + 13 * i + j) % vocab for j in range(prompt_len)] for i in range(batch)]
    firsts: list[float] = []
    start = time.perf_counter()
    counts = await asyncio.gather(*(_one(engine, p, gen_len, firsts) for p in prompts))
    end = time.perf_counter()
    decode_tokens = sum(counts) - batch
    decode_time = end - max(firsts)
    return {"batch": batch, "ttft_s": min(firsts) - start, "last_first_token_s": max(firsts) - start,
            "decode_tok_s": decode_tokens / decode_time if decode_time > 0 else float("nan"),
            "per_seq_tok_s": (gen_len - 1) / decode_time if decode_time > 0 else float("nan"),
            "total_s": end - start}


def run_bench(model: str | None, device: str, prompt_len: int, prefill_len: int, gen_len: int,
              batch_sizes: list[int], overlap: bool = True) -> dict:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.models.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model(model, device=device)
    need = max(max(batch_sizes) * (prompt_len + gen_len), prefill_len + 16)
    # The prompts repeat (prompt 0 of every batch is a prefix of the prefill prompt): without
    # the prefix cache, every prompt token is computed, which is what this measures.
    config = EngineConfig(num_tokens=need + 256, max_num_seqs=max(batch_sizes),
                          max_prefill_tokens=max(prefill_len, 2048), device=device,
                          prefix_cache=False, overlap=overlap)
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    ready = time.perf_counter() - t0
    vocab = loaded.config.vocab_size
    try:
        asyncio.run(_batch(engine, 1, 16, 4, vocab))  # settle allocations and graphs
        prefill = asyncio.run(_batch(engine, 1, prefill_len, 1, vocab))
        rows = [asyncio.run(_batch(engine, b, prompt_len, gen_len, vocab)) for b in batch_sizes]
    finally:
        engine.shutdown()
    return {"model": loaded.name, "device": str(loaded.model.device), "start_to_ready_s": ready,
            "prefill_tokens": prefill_len, "prefill_tok_s": prefill_len / prefill["ttft_s"],
            "ttft_s": rows[0]["ttft_s"], "prompt_len": prompt_len, "gen_len": gen_len,
            "batches": rows}


@click.command("bench")
@click.option("--model", default=None, help="GGUF file, HF folder or Hugging Face repository "
                                            "ORG/NAME[:QUANT] (default: embedded model).")
@click.option("--device", default="auto", show_default=True)
@click.option("--prompt-len", default=128, show_default=True, type=click.IntRange(1))
@click.option("--prefill-len", default=1024, show_default=True, type=click.IntRange(1))
@click.option("--gen-len", default=64, show_default=True, type=click.IntRange(2))
@click.option("--batch-sizes", default="1,8,32,64", show_default=True)
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="GPU: schedule the next decode step while the current one runs.")
@click.option("--json", "as_json", is_flag=True)
def bench_command(model, device, prompt_len, prefill_len, gen_len, batch_sizes, overlap,
                  as_json) -> None:
    """Measure prefill and decode throughput and time to first token through the engine."""
    try:
        sizes = [int(b) for b in batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise click.BadParameter("comma-separated integers, e.g. 1,8,32", param_hint="--batch-sizes")
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("batch sizes must be >= 1", param_hint="--batch-sizes")
    if device == "auto":
        from freetoken.engine.config import resolve_device

        device = resolve_device(device)
    from freetoken.cli.pull import resolve_model_option

    model = resolve_model_option(model)[0]
    result = run_bench(model, device, prompt_len, prefill_len, gen_len, sizes, overlap)
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    click.echo(f"{result['model']} on {result['device']}: ready in {result['start_to_ready_s']:.2f} s")
    click.echo(f"prefill {result['prefill_tokens']} tokens: {result['prefill_tok_s']:.0f} tok/s; "
               f"time to first token ({prompt_len}-token prompt): {result['ttft_s'] * 1e3:.1f} ms")
    for row in result["batches"]:
        click.echo(f"batch {row['batch']:>3}: decode {row['decode_tok_s']:9.1f} tok/s total, "
                   f"{row['per_seq_tok_s']:7.1f} tok/s per sequence")
