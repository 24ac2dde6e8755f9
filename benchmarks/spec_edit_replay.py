"""Prompt lookup on an agent's edit: the model rewrites a 300-line Python file with three edits,
greedy, with speculative decoding off and with n-gram drafts (K tokens per step), beside
llama.cpp's own prompt-lookup decoding (llama-lookup) on the same GGUF and the same prompt.

    python benchmarks/spec_edit_replay.py [--model GGUF] [--device cpu|cuda] [--k 2,3,4]
        [--max-tokens N] [--threads N] [--results FILE]

FreeToken runs in-process (engine, chat template of the model applied once; the same text goes
to llama-lookup with -f): decode tok/s from the first output token to the last, the draft
acceptance rate and the mean tokens per verify step; every speculative run's tokens are checked
equal to the run without drafts (greedy verification changes nothing but the speed).

llama.cpp: `llama-lookup -m FILE -f PROMPT -n N --spec-draft-n-max K --temp 0` (its n-gram cache built from
the prompt and the output as it goes), its decode speed and acceptance as it prints them. On
the CPU the tools come from benchmarks/build_llama_cpp.sh; with --device cuda from the CUDA peer
build (benchmarks/llama_cpp_cuda). A missing tool leaves the llama.cpp rows out, saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

EDITS = ("rename the function `restock_level` to `reorder_point` (and every call of it)",
         "change `LOW_STOCK_THRESHOLD = 12` to `LOW_STOCK_THRESHOLD = 20`",
         "add a line `    total = round(total, 2)` just before `return total` in `order_total`")


def source_file(lines: int = 300) -> str:
    """A deterministic Python module of about `lines` lines: small inventory functions."""
    out = ['"""Inventory helpers for the warehouse service."""', "",
           "LOW_STOCK_THRESHOLD = 12", "TAX_RATE = 0.08", ""]
    items = ["apple", "bolt", "cable", "drill", "engine", "filter", "gasket", "hinge",
             "insulator", "jack", "kettle", "lever", "magnet", "nozzle", "oven", "pump"]
    out += ["", "def order_total(prices, quantities):",
            "    total = 0.0",
            "    for price, qty in zip(prices, quantities):",
            "        total += price * qty * (1 + TAX_RATE)",
            "    return total", "", "",
            "def restock_level(daily_use, lead_days):",
            "    return daily_use * lead_days + LOW_STOCK_THRESHOLD", ""]
    i = 0
    while len(out) < lines - 8:
        item = items[i % len(items)]
        n = i // len(items)
        out += ["", f"def check_{item}_{n}(stock, daily_use):",
                f'    """Whether {item} stock (batch {n}) needs a reorder."""',
                f"    level = restock_level(daily_use, {3 + i % 5})",
                "    if stock < level:",
                f"        return {{'item': '{item}', 'order': level - stock}}",
                "    return None", ""]
        i += 1
    return "\n".join(out) + "\n"


def prompt_text(tokenizer) -> str:
    code = source_file()
    user = ("Here is `inventory.py`:\n\n```python\n" + code + "```\n\nMake these edits:\n"
            + "".join(f"{i + 1}. {e}\n" for i, e in enumerate(EDITS))
            + "\nReply with the complete updated file in one ```python block and nothing else.")
    # the reply is begun as an agent's rewrite begins (the fence and the file's first lines), so
    # a small model copies rather than invents; it ends mid-line: llama.cpp's -f drops a file's
    # last newline, and both engines must see the same tokens
    start = "\n".join(code.split("\n")[:2]) + "\n\nLOW_STOCK_THRESHOLD ="
    return tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                         add_generation_prompt=True) + "```python\n" + start


def freetoken_runs(args, loaded, prompt_ids: list[int]) -> dict:
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams

    rows, reference = {}, None
    for k in [0] + args.k:
        config = EngineConfig(device=args.device, max_num_seqs=1, prefix_cache=False,
                              speculative="ngram" if k else "off",
                              num_speculative_tokens=max(k, 1),
                              max_prefill_tokens=len(prompt_ids) + 16)
        engine = Engine.from_loaded(loaded, config).start()
        try:
            engine.warm_up()
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            times, tokens = [], []

            async def run():
                async for out in engine.generate(prompt_ids, params):
                    times.append(time.perf_counter())
                    tokens.extend(out.token_ids)

            start = time.perf_counter()
            asyncio.run(run())
            stats = engine.stats()
        finally:
            engine.shutdown()
        # outputs of one verify step arrive together: time from the first to the last token
        decode = (len(tokens) - 1) / (times[-1] - times[0])
        row = {"decode_tok_s": decode, "ttft_s": times[0] - start, "tokens": len(tokens)}
        if k:
            row.update({key: stats[key] for key in ("spec_acceptance_rate",
                                                    "spec_mean_accepted_length",
                                                    "spec_draft_tokens", "spec_accepted_tokens")})
            row["same_tokens_as_off"] = tokens == reference
        else:
            reference = tokens
            rows["text"] = loaded.tokenizer.decode(tokens)
        rows[f"k{k}"] = row
        print(f"FreeToken {'off' if not k else f'ngram K={k}'}: {decode:.1f} tok/s"
              + (f", acceptance {row['spec_acceptance_rate']:.2f}, "
                 f"{row['spec_mean_accepted_length']:.2f} tokens/verify step, "
                 f"same tokens as off: {row['same_tokens_as_off']}" if k else ""), flush=True)
    return rows


def llama_lookup_runs(args, text: str) -> dict:
    """llama-lookup at each K (and K's speed/acceptance as it prints them), or {skipped}."""
    try:
        binary = lookup_binary(args.device)
    except Exception as exc:  # noqa: BLE001 - reported as the peer's absence
        return {"skipped": str(exc)}
    rows = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    # newer llama.cpp renamed --draft to --spec-draft-n-max
    draft_flag = "--spec-draft-n-max" if "--spec-draft-n-max" in help_text else "--draft"
    for k in args.k:
        command = [str(binary), "-m", args.model, "-f", f.name, "-n", str(args.max_tokens),
                   draft_flag, str(k), "--temp", "0", "--ignore-eos", "-c", "8192",
                   "-b", "8192", "-ub", "8192", "-t", str(args.threads)]
        if args.device == "cuda":
            command += ["-ngl", "99"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 and args.device == "cpu":
            # ggml's AMX repack crashes on some CPUs (see benchmarks/llama_tools.py)
            result = subprocess.run(command + ["--no-repack"], capture_output=True, text=True)
        log = result.stdout + result.stderr
        row = parse_lookup(log)
        if result.returncode != 0 or "decode_tok_s" not in row:
            row["error"] = f"exit {result.returncode}: {log.strip().splitlines()[-3:]}"
        rows[f"k{k}"] = row
        print(f"llama-lookup --draft {k}: {json.dumps(row)}", flush=True)
    return rows


def lookup_binary(device: str) -> Path:
    if device == "cuda":
        from benchmarks.llama_cpp_cuda import paths

        return paths.binary("llama-lookup")
    from benchmarks.llama_tools import tool

    return tool("llama-lookup")


def parse_lookup(log: str) -> dict:
    """llama-lookup's summary: "decoded N tokens in S seconds, speed: R t/s", n_draft,
    n_drafted, n_accept, accept."""
    row: dict = {}
    speed = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)", log)
    if speed:
        row.update(tokens=int(speed.group(1)), decode_s=float(speed.group(2)),
                   decode_tok_s=float(speed.group(3)))
    for key in ("n_drafted", "n_accept"):
        m = re.search(rf"{key}\s*=\s*(\d+)", log)
        if m:
            row[key] = int(m.group(1))
    m = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if m:
        row["acceptance"] = float(m.group(1)) / 100
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--k", default="2,3,4", help="draft tokens per step, comma-separated")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    p.add_argument("--results", type=Path, default=None)
    p.add_argument("--engines", default="freetoken,llama.cpp")
    args = p.parse_args()
    args.k = [int(k) for k in args.k.split(",") if k]
    if not args.k or any(not 1 <= k <= 4 for k in args.k):
        raise SystemExit("--k: draft lengths in 1..4, comma-separated")
    import os

    args.threads = args.threads or os.cpu_count()
    from freetoken.models.checkpoint.default import default_model_path
    from freetoken.models.loader import load_model

    args.model = args.model or str(default_model_path())
    loaded = load_model(args.model, device=args.device)
    text = prompt_text(loaded.tokenizer)
    prompt_ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    print(f"model {args.model}; prompt {len(prompt_ids)} tokens; {args.max_tokens} output tokens",
          flush=True)
    results = {"model": args.model, "device": args.device, "prompt_tokens": len(prompt_ids),
               "max_tokens": args.max_tokens}
    engines = set(args.engines.split(","))
    if "freetoken" in engines:
        results["freetoken"] = freetoken_runs(args, loaded, prompt_ids)
    if "llama.cpp" in engines:
        results["llama.cpp"] = llama_lookup_runs(args, text)
    off = results.get("freetoken", {}).get("k0", {}).get("decode_tok_s")
    for k in args.k:
        ours = results.get("freetoken", {}).get(f"k{k}", {}).get("decode_tok_s")
        peer = results.get("llama.cpp", {}).get(f"k{k}", {}).get("decode_tok_s")
        print(f"K={k}: FreeToken {ours or '-'} tok/s"
              + (f" ({ours / off:.2f}x its own plain decode)" if ours and off else "")
              + (f", llama-lookup {peer} tok/s ({ours / peer:.2f}x)" if ours and peer else ""))
    if args.results:
        args.results.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
