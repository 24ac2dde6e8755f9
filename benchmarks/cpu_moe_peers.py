"""A small MoE on the CPU: FreeToken beside llama.cpp's llama-bench on the same GGUF file.

    python benchmarks/cpu_moe_peers.py [--rounds 3] [--threads 2] [--outtype q8_0]

Random weights of a small Qwen3-MoE shape (hidden 512, 8 layers, 32 experts, 4 per token,
expert width 256) are saved as an HF folder and converted by llama.cpp's own converter
(benchmarks/llama_cpp_cuda: its sources staged on first use), so both engines read one file in
llama.cpp's MoE layout. FreeToken runs in-process through the engine (`ft bench`'s code,
batch 1); llama-bench comes from benchmarks/build_llama_cpp.sh, flash attention on. Rounds are
interleaved; min/median/max are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# appended, not first: transformers imports the installed `kernels` package (hub kernels) when
# it is present, which this repository's kernels/ folder would otherwise shadow
sys.path.append(str(REPO))

from benchmarks import llama_tools  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
             num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=1000000.0,
             max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)


def make_gguf(directory: Path, outtype: str) -> Path:
    """The random-weight folder, converted by llama.cpp's converter (placeholder vocabulary)."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(**SHAPE, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).eval().save_pretrained(directory / "hf")
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.convert import convert
    from benchmarks.llama_cpp_cuda.stage import stage

    if not (paths.staged_dir() / paths.SOURCES).is_file():
        stage(paths.staged_dir())
    return convert(directory / "hf", directory / f"moe-{outtype}.gguf", outtype)


def freetoken_round(gguf: Path, prompt: int, gen: int) -> dict:
    from freetoken.cli.bench import run_bench

    result = run_bench(str(gguf), "cpu", prompt, prompt, gen, [1])
    return {"prompt_tok_s": result["prefill_tok_s"],
            "decode_tok_s": result["batches"][0]["decode_tok_s"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} [{min(values):.1f}-{max(values):.1f}]"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--outtype", default="q8_0", choices=["q8_0", "f16", "f32"])
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args()
    os.environ["FREETOKEN_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = make_gguf(Path(tmp), args.outtype)
        rows: dict[str, list[dict]] = {"freetoken": [], "llama.cpp": []}
        for _ in range(args.rounds):
            rows["freetoken"].append(freetoken_round(gguf, args.prompt, args.gen))
            try:
                peer = llama_tools.bench_round(str(gguf), args.threads, [args.prompt], args.gen)
                rows["llama.cpp"].append({"prompt_tok_s": peer["prompt_tok_s"][str(args.prompt)],
                                          "decode_tok_s": peer["decode_tok_s"]})
            except llama_tools.ToolUnavailable as exc:
                print(f"llama.cpp skipped: {exc}")
    print(f"\nQwen3-MoE-shaped (hidden 512, 8 layers, 32 experts top-4), {args.outtype}, "
          f"{args.threads} threads, {args.rounds} interleaved rounds: median [min-max]")
    print(f"{'':12}{'prompt ' + str(args.prompt) + ' tok/s':>26}{'decode tok/s':>26}")
    for name, results in rows.items():
        if results:
            print(f"{name:12}{spread([r['prompt_tok_s'] for r in results]):>26}"
                  f"{spread([r['decode_tok_s'] for r in results]):>26}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
