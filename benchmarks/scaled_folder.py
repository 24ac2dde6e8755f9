"""A bf16 HF folder re-written as an FP8 or NVFP4 checkpoint, in the layouts FreeToken's loader
reads (runtime/freetoken/models/checkpoint/hf_quant.py), one safetensors shard at a time.

- fp8: config.json quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size:
  [128, 128]} (as Qwen and DeepSeek publish FP8 models): each linear weight as float8_e4m3fn with
  a float32 `weight_scale_inv` per 128x128 block (ceil-div edges) that multiplies it;
- nvfp4: ModelOpt NVFP4 {quant_method: modelopt, quant_algo: NVFP4, group_size: 16}: two e2m1
  values per byte in `weight`, an e4m3 `weight_scale` per 16 values of a row and a float32
  `weight_scale_2` per matrix, both multiplying.

Quantized: the attention, MLP, shared-expert and routed-expert projections (transformers 5's
fused [E, 2I, H] gate_up_proj and [E, H, I] down_proj included). Left in bf16: embeddings, the
LM head, norms, routers and every other tensor (a Gated DeltaNet layer's projections among
them). The quantizers work on the GPU when there is one, a few experts at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.(gate_up|down)_proj$")
FORMATS = ("fp8", "nvfp4")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX, E2M1_MAX = 448.0, 6.0
_CHUNK = 16                 # leading (expert) rows quantized at once


def quantization_config(fmt: str) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head"]}


def companion(name: str, suffix: str) -> str:
    """x.weight -> x.<suffix>; a fused expert tensor x.gate_up_proj -> x.gate_up_proj_<rest>."""
    return name[:-len("weight")] + suffix if name.endswith(".weight") \
        else name + suffix[len("weight"):]


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [..., O, I], float32 scales [..., ceil(O/b), ceil(I/b)]): each block's largest
    magnitude maps to 448."""
    *lead, rows, cols = w.shape
    go, gi = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(w, (0, gi * block - cols, 0, go * block - rows))
    blocks = padded.reshape(*lead, go, block, gi, block)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / E4M3_MAX
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, go * block, gi * block)
    return q[..., :rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale.float()


def nvfp4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., O, I/2] with the even column in the low nibble, e4m3 scales
    [..., O, I/16], float32 second-level scale [...]): value = e2m1 * scale * second, each
    group's largest magnitude at 6, the matrix's largest scale at 448. Rounds to the nearest
    e2m1 magnitude (ties to the smaller)."""
    *lead, rows, cols = w.shape
    second = w.abs().flatten(-2).amax(-1).clamp(min=1e-12) / (E4M3_MAX * E2M1_MAX)
    groups = w.reshape(*lead, rows, cols // 16, 16)
    local = (groups.abs().amax(-1) / E2M1_MAX / second[..., None, None]).to(torch.float8_e4m3fn)
    step = local.float() * second[..., None, None]
    x = groups / torch.where(step == 0, torch.ones_like(step), step)[..., None]
    grid = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
    code = torch.bucketize(x.abs(), (grid[1:] + grid[:-1]) / 2).clamp(max=7)
    code = (code | torch.where(x < 0, 8, 0)).reshape(*lead, rows, cols).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), local.contiguous(), \
        second.float()


def _encode(fmt: str, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors written for weight `name` (float32 `w`, any device), on the CPU."""
    parts: dict[str, list[torch.Tensor]] = {}
    chunks = w.split(_CHUNK) if w.dim() == 3 else [w]
    for chunk in chunks:
        if fmt == "fp8":
            q, scale = fp8_blocks(chunk)
            pieces = {name: q, companion(name, "weight_scale_inv"): scale}
        else:
            packed, local, second = nvfp4_groups(chunk)
            pieces = {name: packed, companion(name, "weight_scale"): local,
                      companion(name, "weight_scale_2"): second}
        for key, value in pieces.items():
            parts.setdefault(key, []).append(value.cpu())
    return {k: torch.cat(v) if w.dim() == 3 else v[0] for k, v in parts.items()}


def write_scaled(src: Path, dst: Path, fmt: str) -> Path:
    """Quantize the bf16 folder `src` into `dst` (shard by shard); tokenizer files copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scratch = dst.with_name(dst.name + ".part")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    weight_map = {}
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(str(shard), "pt", device=device) as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if LINEAR.search(name) and t.dtype in (torch.bfloat16, torch.float16,
                                                       torch.float32):
                    out.update(_encode(fmt, name, t.float()))
                else:
                    out[name] = t.cpu()
        save_file(out, str(scratch / shard.name), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in out})
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json" \
                and not extra.name.endswith(".index.json"):
            shutil.copy(extra, scratch / extra.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt)
    (scratch / "config.json").write_text(json.dumps(config, indent=1))
    (scratch / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.rmtree(dst, ignore_errors=True)
    scratch.rename(dst)
    return dst
