"""Prefix caching on a replayed agent conversation: time to first token per turn.

Ten turns of one conversation (a ~4k-token system prompt with tool definitions, then per turn
a user message, the assistant's tool call and the tool's result), each sent whole, as an agent
does. Per turn: TTFT of FreeToken without and with the prefix cache (a fresh engine each), the
tokens the cache served, and llama.cpp (llama-cpp-python) with its prompt cache (the same Llama
object across turns: it reuses the longest common prefix of its last prompt), where installed.
Goal: from turn 2 on, TTFT follows the new tokens, not the history.

    python benchmarks/prefix_cache.py [--threads 2] [--turns 10] [--system-tokens 4000]
    python benchmarks/prefix_cache.py --device cuda --model PATH   # a GPU model (HF or GGUF)
    ... --llama-server [--llama-gguf F.gguf]   # llama.cpp's llama-server (LLAMA_CPP_BIN) as peer
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

TOOL = {"type": "function", "function": {
    "name": "tool_{i}", "description": "Tool {i}: reads or changes the workspace. Use it when "
    "the task needs {topic}; it returns a JSON object with the result and any warnings.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string", "description": "File or folder, relative to the repository"},
        "pattern": {"type": "string", "description": "A regular expression to look for"},
        "limit": {"type": "integer", "description": "Most results to return (default 50)"}}}}}
TOPICS = ("searching code", "reading a file", "editing a file", "running tests", "listing a "
          "folder", "git history", "building", "formatting", "type checking", "benchmarks")


def system_prompt(tokenizer, target_tokens: int) -> str:
    """An agent's system prompt: rules, then tool definitions until it holds target tokens."""
    text = ("You are a coding agent working in a Python repository. Think before each step, "
            "call one tool at a time, and report what you changed. Tools:\n")
    i = 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < target_tokens:
        tool = json.dumps(TOOL).replace("{i}", str(i)).replace("{topic}", TOPICS[i % 10])
        text += tool + "\n"
        i += 1
    return text


def turn_messages(turn: int) -> list[dict]:
    """What turn `turn` adds after the first: the last reply, the tool result, a new ask."""
    call = json.dumps({"name": f"tool_{turn % 7}", "arguments": {
        "path": f"src/module_{turn}.py", "pattern": f"def handler_{turn}"}})
    result = "\n".join(f"src/module_{turn}.py:{10 * k + turn}: def handler_{turn}_{k}(request, "
                       f"context): return dispatch(request, {k})" for k in range(6))
    return [{"role": "assistant", "content": f"I will look at module {turn}. {call}"},
            {"role": "user", "content": f"Tool result:\n{result}\nNow fix the failing test "
                                        f"test_handler_{turn} and explain the change briefly."}]


def conversation(tokenizer, turns: int, system_tokens: int) -> list[list[int]]:
    """Prompt token ids of every turn (each the whole conversation so far)."""
    messages = [{"role": "system", "content": system_prompt(tokenizer, system_tokens)},
                {"role": "user", "content": "Run the tests and fix what fails."}]
    prompts = []
    for turn in range(1, turns + 1):
        if turn > 1:
            messages += turn_messages(turn - 1)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def freetoken_ttfts(loaded, prompts, device: str, cache: bool) -> list[tuple[float, int]]:
    """(TTFT seconds, cached prompt tokens) per turn on a fresh engine."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams

    need = max(len(p) for p in prompts) + 64
    config = EngineConfig(num_tokens=need, device=device, prefix_cache=cache)
    engine = Engine.from_loaded(loaded, config).start()
    engine.warm_up()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    async def first_token(ids):
        start = time.perf_counter()
        outs = [out async for out in engine.generate(ids, params)]
        if outs[-1].finish_reason == "error":
            raise RuntimeError(outs[-1].error)
        return time.perf_counter() - start, outs[-1].usage.cached_tokens

    try:
        return [asyncio.run(first_token(ids)) for ids in prompts]
    finally:
        engine.shutdown()


def llama_cpp_ttfts(model: str, prompts, threads: int, gpu: bool) -> list[float] | str:
    """llama.cpp TTFT per turn with its prompt cache, or why it cannot run here."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama-cpp-python is not installed (`pip install llama-cpp-python`)"
    if not model.endswith(".gguf"):
        return "llama.cpp needs a GGUF model"
    llm = Llama(model_path=model, n_ctx=max(len(p) for p in prompts) + 64, n_batch=1024,
                n_ubatch=1024, n_threads=threads, n_threads_batch=threads,
                n_gpu_layers=-1 if gpu else 0, verbose=False, seed=0)
    next(llm.generate(prompts[0][:4], temp=0.0, top_k=1))   # warm-up
    llm.reset()
    stamps = []
    for ids in prompts:
        start = time.perf_counter()
        next(llm.generate(ids, temp=0.0, top_k=1, reset=True))  # reuses its common prefix
        stamps.append(time.perf_counter() - start)
    return stamps


def llama_server_ttfts(model: str, prompts, threads: int, gpu: bool) -> list[float] | str:
    """llama-server TTFT per turn with `cache_prompt` (its slot keeps the last prompt's KV and
    reuses the common prefix), prompts sent as token ids; or why it cannot run here."""
    from llama_tools import LlamaServer, ToolUnavailable

    if not model.endswith(".gguf"):
        return "llama.cpp needs a GGUF model: pass --llama-gguf"
    try:
        server = LlamaServer(model, threads, ctx=max(len(p) for p in prompts) + 64, gpu=gpu)
        server.wait_ready()
    except ToolUnavailable as exc:
        return str(exc)
    try:
        body = {"n_predict": 1, "temperature": 0.0, "cache_prompt": True}
        server.post("/completion", {**body, "prompt": prompts[0][:4]})      # warm-up
        stamps = []
        for ids in prompts:
            start = time.perf_counter()
            server.post("/completion", {**body, "prompt": ids})
            stamps.append(time.perf_counter() - start)
        return stamps
    finally:
        server.close()


def print_table(prompts, off, on, llama) -> None:
    has_llama = not isinstance(llama, str)
    print(f"{'turn':>4} {'prompt':>7} {'new':>5} {'no cache ms':>12} {'cache ms':>9} "
          f"{'cached':>7} {'ms/new tok':>10}" + (f" {'llama.cpp ms':>13}" if has_llama else ""))
    for t, ids in enumerate(prompts):
        new = len(ids) - (on[t][1])
        row = (f"{t + 1:>4} {len(ids):>7} {new:>5} {off[t][0] * 1e3:>12.1f} "
               f"{on[t][0] * 1e3:>9.1f} {on[t][1]:>7} {on[t][0] * 1e3 / new:>10.2f}")
        print(row + (f" {llama[t] * 1e3:>13.1f}" if has_llama else ""))
    if not has_llama:
        print(f"llama.cpp: skipped ({llama})")
    later = range(1, len(prompts))
    speedup = sum(off[t][0] for t in later) / sum(on[t][0] for t in later)
    print(f"turns 2..{len(prompts)}: the prefix cache cuts total TTFT x{speedup:.1f}; "
          "new = prompt tokens not served from the cache (prefilled)")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: "
                                                      "the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=4000)
    parser.add_argument("--skip-llama-cpp", action="store_true")
    parser.add_argument("--llama-gguf", default=None,
                        help="the same weights as GGUF for llama.cpp (default: --model when it "
                             "is a GGUF file)")
    parser.add_argument("--llama-server", action="store_true",
                        help="measure llama.cpp through llama-server (LLAMA_CPP_BIN) instead "
                             "of llama-cpp-python")
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ.setdefault("FREETOKEN_NUM_THREADS", str(args.threads))
    from freetoken.models.checkpoint.default import default_model_path
    from freetoken.models.loader import load_model

    model = args.model or str(default_model_path())
    loaded = load_model(model, device=args.device)
    prompts = conversation(loaded.tokenizer, args.turns, args.system_tokens)
    if len(prompts[-1]) + 64 > loaded.config.max_position:
        sys.exit(f"the last turn ({len(prompts[-1])} tokens) exceeds the model's context "
                 f"({loaded.config.max_position}); lower --system-tokens or --turns")
    print(f"{Path(model).name} on {args.device}, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; turns of {', '.join(str(len(p)) for p in prompts)} "
          "prompt tokens", flush=True)
    off = freetoken_ttfts(loaded, prompts, args.device, cache=False)
    on = freetoken_ttfts(loaded, prompts, args.device, cache=True)
    peer = llama_server_ttfts if args.llama_server else llama_cpp_ttfts
    llama = ("skipped (--skip-llama-cpp)" if args.skip_llama_cpp else
             peer(args.llama_gguf or model, prompts, args.threads, args.device == "cuda"))
    print_table(prompts, off, on, llama)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "model": Path(model).name, "device": args.device, "threads": args.threads,
            "prompt_tokens": [len(p) for p in prompts], "ttft_no_cache_s": [t for t, _ in off],
            "ttft_cache_s": [t for t, _ in on], "cached_tokens": [c for _, c in on],
            "llama_cpp_prompt_cache_s": llama}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
