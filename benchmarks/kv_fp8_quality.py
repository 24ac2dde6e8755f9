"""What the FP8 KV pool (--kv-dtype fp8) costs in quality: perplexity of the embedded model
(SmolLM2-135M-Instruct, real weights) over a 4k-token text, and the logit error on random
weights, each beside a float KV pool on the same device.

    python benchmarks/kv_fp8_quality.py [--device cpu|cuda] [--tokens 4096] [--chunk 512]
        [--results FILE]

Text: this repository's docs/*.md in name order, concatenated, cut to --tokens tokens (real
English and code, reproducible from the repository alone). The model runs the text as one
sequence in --chunk-token prefill chunks (so later chunks read earlier tokens' K/V from the pool),
with logits for every position; perplexity = exp(mean negative log-likelihood of each next
token). Baseline pool: float16 on the CPU (its default), the activation dtype on a GPU.

Random weights: a Qwen3-shaped model (hidden 1024, 8 layers, 16 query and 4 KV heads of 128,
random bf16-scale weights) over a 2,048-token random prompt, the same chunks: the largest
|logit difference| over the largest |logit|, the mean KL divergence of the next-token
distributions, and how often the top token agrees.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))


def docs_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))


def all_logits(model, tokens: list[int], kv_dtype: str, chunk: int, block_size: int = 16):
    """float32 logits [len(tokens), vocab] of one sequence run in `chunk`-token prefill steps
    over a pool of `kv_dtype`."""
    import torch

    from freetoken.models.batch import ForwardBatch, KVCache

    n = len(tokens)
    pages = -(-n // block_size)
    kv = KVCache(model.config, pages, block_size, kv_dtype, model.arrays)
    index = model.arrays.index
    table = np.arange(pages, dtype=np.int32)[None]
    rows = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        positions = np.arange(start, end, dtype=np.int64)
        batch = ForwardBatch(
            input_ids=index(np.asarray(tokens[start:end], dtype=np.int64)),
            positions=index(positions), slot_mapping=index(positions.copy()),
            block_tables=index(table), seq_lens=index(np.array([end], dtype=np.int32)),
            query_start_loc=index(np.array([0, end - start], dtype=np.int32)),
            logits_indices=index(np.arange(end - start, dtype=np.int64)),
            max_query_len=end - start)
        rows.append(torch.as_tensor(model.forward(batch, kv)).float().cpu().clone())
    return torch.cat(rows)


def perplexity(logits, tokens: list[int]) -> float:
    import torch

    logp = torch.log_softmax(logits[:-1].double(), -1)
    nll = -logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    return math.exp(float(nll.mean()))


def compare(base, fp8) -> dict:
    import torch

    p = torch.log_softmax(base.double(), -1)
    q = torch.log_softmax(fp8.double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    return {"max_abs_diff_over_max_abs_logit":
            float((fp8 - base).abs().max() / base.abs().max()),
            "mean_kl": kl,
            "top1_agreement": float((fp8.argmax(-1) == base.argmax(-1)).double().mean())}


def random_qwen3(directory: Path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=4096, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                         head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    from tests.models.helpers import write_byte_bpe
    write_byte_bpe(directory, vocab_size=config.vocab_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args()
    if args.tokens < 2 or args.chunk < 1:
        raise SystemExit("--tokens must be >= 2 and --chunk >= 1")

    from freetoken.engine.config import resolve_kv_dtype
    from freetoken.models.checkpoint.default import default_model_path
    from freetoken.models.loader import load_model

    out = {"device": args.device}
    loaded = load_model(str(default_model_path()), device=args.device)
    model = loaded.model
    base_dtype = resolve_kv_dtype("auto", args.device == "cpu", model.dtype)
    tokens = loaded.tokenizer.encode(docs_text())[:args.tokens]
    if len(tokens) < args.tokens:
        raise SystemExit(f"the docs give only {len(tokens)} tokens")
    base = all_logits(model, tokens, base_dtype, args.chunk)
    fp8 = all_logits(model, tokens, "fp8", args.chunk)
    out["embedded"] = {"tokens": len(tokens), "base_kv_dtype": base_dtype,
                       "perplexity_base": perplexity(base, tokens),
                       "perplexity_fp8": perplexity(fp8, tokens), **compare(base, fp8)}
    print(json.dumps(out["embedded"]), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        random_qwen3(Path(tmp))
        loaded = load_model(tmp, device=args.device)
        model = loaded.model
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, model.config.vocab_size, 2048).tolist()
        base_dtype = resolve_kv_dtype("auto", args.device == "cpu", model.dtype)
        base = all_logits(model, prompt, base_dtype, args.chunk)
        fp8 = all_logits(model, prompt, "fp8", args.chunk)
        out["random_qwen3"] = {"tokens": len(prompt), "base_kv_dtype": base_dtype,
                               "model_dtype": model.dtype, **compare(base, fp8)}
        print(json.dumps(out["random_qwen3"]), flush=True)
    if args.results:
        args.results.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
