"""Write a full-depth MoE checkpoint in FP8 directly, as an HF folder of one safetensors shard a
layer: random weights drawn a layer at a time, never a float copy of the model.

    python benchmarks/write_fp8_folder.py OUT_DIR [--model qwen3-30b-a3b|qwen3.6-35b-a3b|tiny]
        [--layers N] [--seed 0] [--sigma 0.02]

The shapes are the real configs' (benchmarks/gpu_moe.py's QWEN3_30B_A3B, 48 layers, ~31 GB in
FP8; benchmarks/gpu_hybrid.py's QWEN36_35B_A3B, 40 layers, ~37 GB); their bf16 folders (~61 and
~70 GB) would not fit the benchmark machine's disk beside anything else. Tensor names and shapes
come from transformers' own model of the config, built on the meta device (nothing allocated),
with the routed experts as transformers 5 holds them: fused `experts.gate_up_proj` [E, 2I, H]
and `experts.down_proj` [E, H, I], which FreeToken reads as stacked experts.

FP8 as Qwen and DeepSeek publish it (benchmarks/scaled_folder.py's `quantization_config`):
float8_e4m3fn with a float32 `*_scale_inv` per 128x128 block for the attention, MLP,
shared-expert and routed-expert projections; bf16 for the rest (embeddings, LM head, norms,
routers, Gated DeltaNet projections). Values: projections normal of std `sigma` before
quantization, routers and embeddings likewise in bf16; norm weights ones; a Gated DeltaNet
layer's conv filter normal of std 1/sqrt(K), dt_bias ones, A_log = log(uniform [1, 16)).
Drawn on the GPU when there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))

from benchmarks.scaled_folder import LINEAR, fp8_blocks, quantization_config  # noqa: E402

FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
EXPERT_CHUNK = 16          # experts drawn and quantized at once
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
            num_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=4096, num_hidden_layers=2)


def model_config(model: str, layers: int | None):
    """(transformers config, model class) of a --model name at `layers` layers (None: all)."""
    import transformers

    from benchmarks.gpu_hybrid import QWEN36_35B_A3B
    from benchmarks.gpu_moe import QWEN3_30B_A3B

    if model == "qwen3.6-35b-a3b":
        config = transformers.Qwen3_5MoeTextConfig(
            **QWEN36_35B_A3B, num_hidden_layers=layers or 40, eos_token_id=2, bos_token_id=None)
        return config, transformers.Qwen3_5MoeForCausalLM
    shape = {"qwen3-30b-a3b": {**QWEN3_30B_A3B, "num_hidden_layers": 48}, "tiny": TINY}[model]
    config = transformers.Qwen3MoeConfig(**{**shape, **({"num_hidden_layers": layers}
                                                        if layers else {})},
                                         eos_token_id=2, bos_token_id=None)
    return config, transformers.Qwen3MoeForCausalLM


def tensor_table(config, model_class) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from transformers' model of `config` on the meta device."""
    with torch.device("meta"):
        model = model_class(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def draw(name: str, shape: tuple[int, ...], sigma: float, gen: torch.Generator,
         device: str) -> dict[str, torch.Tensor]:
    """The tensors written for `name` (FP8 and its scales, or one bf16 tensor), on the CPU."""
    if name.endswith(FUSED_EXPERTS) or LINEAR.search(name):
        values, scales = [], []
        experts = shape[0] if len(shape) == 3 else 1
        for start in range(0, experts, EXPERT_CHUNK):
            count = min(EXPERT_CHUNK, experts - start)
            rows = (count,) + shape[1:] if len(shape) == 3 else shape
            w = torch.randn(rows, generator=gen, device=device) * sigma
            q, s = fp8_blocks(w)
            values.append(q.cpu())
            scales.append(s.cpu())
        scale_name = name[:-len("weight")] + "weight_scale_inv" if name.endswith(".weight") \
            else name + "_scale_inv"
        if len(shape) == 3:
            return {name: torch.cat(values), scale_name: torch.cat(scales)}
        return {name: values[0], scale_name: scales[0]}
    if name.endswith("A_log"):
        w = torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen))
    elif name.endswith("dt_bias") or "norm" in name.rsplit(".", 2)[-2]:
        w = torch.ones(shape, device=device)
    elif "conv1d" in name:
        w = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[-1])
    else:
        w = torch.randn(shape, generator=gen, device=device) * sigma
    return {name: w.to(torch.bfloat16).cpu()}


def write_folder(out: Path, model: str = "qwen3-30b-a3b", layers: int | None = None,
                 seed: int = 0, sigma: float = 0.02, progress=print) -> dict:
    """Write the folder into `out` (built beside it, renamed into place once complete); returns
    {"bytes", "tensors", "layers"}."""
    from safetensors.torch import save_file

    from tests.models.helpers import write_byte_bpe

    config, model_class = model_config(model, layers)
    table = tensor_table(config, model_class)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    shards: dict[str, list[str]] = {}
    for name in table:
        layer = layer_of(name)
        shard = "model-rest.safetensors" if layer is None else f"model-{layer:05d}.safetensors"
        shards.setdefault(shard, []).append(name)
    weight_map, total, start = {}, 0, time.perf_counter()
    for index, (shard, names) in enumerate(sorted(shards.items())):
        tensors = {}
        for name in names:
            tensors.update(draw(name, table[name], sigma, gen, device))
        save_file(tensors, str(part / shard), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: shard for name in tensors})
        progress(f"shard {index + 1}/{len(shards)} {shard}: {total / 2**30:.1f} GiB in "
                 f"{time.perf_counter() - start:.0f} s")
    settings = config.to_dict()
    settings.update(architectures=[model_class.__name__], torch_dtype="bfloat16",
                    quantization_config=quantization_config("fp8"))
    (part / "config.json").write_text(json.dumps(settings, indent=1))
    (part / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    write_byte_bpe(part)
    shutil.rmtree(out, ignore_errors=True)
    part.rename(out)
    return {"bytes": total, "tensors": len(weight_map), "layers": config.num_hidden_layers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="qwen3-30b-a3b",
                   choices=("qwen3-30b-a3b", "qwen3.6-35b-a3b", "tiny"))
    p.add_argument("--layers", type=int, default=None, help="default: the model's full depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sigma", type=float, default=0.02)
    args = p.parse_args()
    counts = write_folder(args.out, args.model, args.layers, args.seed, args.sigma)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
