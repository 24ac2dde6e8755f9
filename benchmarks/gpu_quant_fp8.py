"""FP8 (128x128 block scales) beside bf16 on one GPU, each against its own byte ceiling.

    python benchmarks/gpu_quant_fp8.py [--layers 8] [--gen 128] [--prefill 2048]

A Qwen3-8B-shaped model (random weights, `--layers` of its 36 layers) is saved in bf16 and
quantized to FP8 e4m3 with `weight_scale_inv` per 128x128 block (quant_method fp8, as Qwen and
DeepSeek publish them; embeddings, norms and the LM head stay bf16). Both run through the engine
(`ft bench`'s code, CUDA graphs). Decode tok/s at batch 1 is set against the ceiling measured in
the same run: D2D copy bandwidth / bytes a decode step must read (every weight but the
embedding, in its stored format with its scales, plus the context's KV). Prefill tok/s of a
`--prefill`-token prompt is printed beside bf16's. The FP8 folder runs twice: as served by
default, and with FREETOKEN_QUANT_GEMV=v3 (fp8_gemv_fused on the fused decode chain).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_decode import d2d_bandwidth  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                rope_theta=1000000.0, max_position_embeddings=40960,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
LINEAR = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
          ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight")


def build_bf16(directory: Path, layers: int) -> dict:
    """Save the bf16 model; return its config dict."""
    import transformers

    from tests.models.helpers import write_byte_bpe

    write_byte_bpe(directory)
    config = transformers.Qwen3Config(**QWEN3_8B, num_hidden_layers=layers, eos_token_id=2,
                                      bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return json.loads((directory / "config.json").read_text())


def quantize_dir(src: Path, dst: Path) -> None:
    """src's bf16 linears as FP8 e4m3 with a float32 scale per 128x128 block."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from tests.models.scaled_checkpoint import quantize_fp8

    dst.mkdir()
    out = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), "pt", device="cuda") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if name.endswith(LINEAR):
                    q, scale = quantize_fp8(t.float(), 128, 128)
                    out[name] = q.cpu()
                    out[name[:-len("weight")] + "weight_scale_inv"] = scale.cpu()
                else:
                    out[name] = t.cpu()
    save_file(out, str(dst / "model.safetensors"))
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json" \
                and not extra.name.endswith(".index.json"):
            shutil.copy(extra, dst / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(config))


def bytes_per_step(directory: Path, config: dict, context: int) -> int:
    """Stored bytes of every tensor but the embedding, plus the KV of `context` tokens (bf16)."""
    from safetensors import safe_open

    total = 0
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if "embed_tokens" not in name:
                    s = f.get_slice(name)
                    count = 1
                    for n in s.get_shape():
                        count *= n
                    total += count * torch.empty(0, dtype=_dtype(s.get_dtype())).element_size()
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    return total + kv * 2 * context


def _dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
            "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8}[name]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--prefill", type=int, default=2048)
    args = p.parse_args()
    from freetoken.cli.bench import run_bench

    bandwidth = d2d_bandwidth()
    print(f"D2D bandwidth (read+write): {bandwidth / 1e12:.2f} TB/s", flush=True)
    results = {"bandwidth_Bps": bandwidth}
    with tempfile.TemporaryDirectory() as tmp:
        bf16_dir, fp8_dir = Path(tmp) / "bf16", Path(tmp) / "fp8"
        bf16_dir.mkdir()
        config = build_bf16(bf16_dir, args.layers)
        quantize_dir(bf16_dir, fp8_dir)
        default = os.environ.get("FREETOKEN_QUANT_GEMV", "v2")
        for name, directory, gemv in (("bf16", bf16_dir, default),
                                      ("fp8-block128", fp8_dir, default),
                                      ("fp8-block128-v3", fp8_dir, "v3")):
            os.environ["FREETOKEN_QUANT_GEMV"] = gemv
            run = run_bench(str(directory), "cuda", args.prompt, args.prefill, args.gen, [1])
            ceiling = bandwidth / bytes_per_step(directory, config, args.prompt + args.gen // 2)
            decode = run["batches"][0]["decode_tok_s"]
            results[name] = {"prefill_tok_s": run["prefill_tok_s"], "decode_tok_s": decode,
                             "ceiling_tok_s": ceiling, "of_ceiling": decode / ceiling}
            print(f"[{name}] prefill {run['prefill_tok_s']:.0f} tok/s; decode batch 1 "
                  f"{decode:.1f} tok/s of a {ceiling:.1f} tok/s ceiling "
                  f"({100 * decode / ceiling:.0f}%)", flush=True)
            torch.cuda.empty_cache()
    bf16 = results["bf16"]
    for name in ("fp8-block128", "fp8-block128-v3"):
        fp8 = results[name]
        print(f"{name} decode {fp8['decode_tok_s'] / bf16['decode_tok_s']:.2f}x bf16; "
              f"prefill {fp8['prefill_tok_s'] / bf16['prefill_tok_s']:.2f}x bf16")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
