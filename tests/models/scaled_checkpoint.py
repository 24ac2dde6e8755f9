"""Tiny FP8 / NVFP4 HF checkpoints quantized from known float weights, and their float reference
dequantized independently of the runtime (numpy, decoding the bytes bit by bit and indexing
each scale by its block as the format defines).

A layout names the scheme and where its tensors live:

- ``fp8-block``: quant_method fp8, ``weight_scale_inv`` per 128x128 block (ceil-div edges);
- ``ct-tensor`` / ``ct-channel`` / ``ct-block``: compressed-tensors float-quantized FP8;
- ``modelopt-fp8``: ModelOpt FP8 (hf_quant_config.json), scalar ``weight_scale``;
- ``modelopt-nvfp4``: ModelOpt NVFP4, ``weight_scale`` e4m3 per 16 and ``weight_scale_2``;
- ``ct-nvfp4``: compressed-tensors nvfp4-pack-quantized (``weight_global_scale`` divides).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

LAYOUTS = ("fp8-block", "ct-tensor", "ct-channel", "ct-block", "modelopt-fp8",
           "modelopt-nvfp4", "ct-nvfp4")
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.(gate_up|down)_proj$")
# modules a scheme leaves in float: listed in its ignore list, so mixed files are exercised
IGNORED = "model.layers.1.self_attn.o_proj"


def e4m3_values(bits: np.ndarray) -> np.ndarray:
    """float64 values of e4m3fn bytes: sign, 4-bit exponent (bias 7), 3-bit mantissa."""
    bits = bits.astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exp, man = (bits >> 3) & 0xF, bits & 0x7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7))
    return sign * value


def e2m1_values(packed: np.ndarray) -> np.ndarray:
    """float64 [..., 2n] of packed bytes [..., n]: the even column in the low nibble."""
    nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    sign = np.where(nibbles & 0x8, -1.0, 1.0)
    return sign * E2M1[nibbles & 0x7]


def expand(grid: np.ndarray, bn: int, bk: int, rows: int, cols: int) -> np.ndarray:
    """scale of every element: grid[..., o // bn, i // bk]."""
    return np.take(np.take(grid, np.arange(rows) // bn, axis=-2), np.arange(cols) // bk, axis=-1)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


# ------------------------------------------------------------------ quantizers (float -> format)

def quantize_fp8(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [..., O, I], float32 scales [..., ceil(O/bn), ceil(I/bk)]) with each block's
    largest magnitude at 448, the format's maximum."""
    *lead, rows, cols = w.shape
    go, gi = -(-rows // bn), -(-cols // bk)
    padded = torch.nn.functional.pad(w, (0, gi * bk - cols, 0, go * bn - rows))
    blocks = padded.reshape(*lead, go, bn, gi, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-8) / 448.0
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, go * bn, gi * bk)
    return q[..., :rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale.float()


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., O, I/2], e4m3 scales [..., O, I/16], per-matrix second-level scale
    [...]) with value ~= e2m1 * scale * second (ModelOpt's convention)."""
    *lead, rows, cols = w.shape
    second = w.abs().flatten(-2).amax(-1).clamp(min=1e-8) / (448.0 * 6.0)
    groups = w.reshape(*lead, rows, cols // 16, 16)
    local = (groups.abs().amax(-1) / 6.0 / second[..., None, None]).to(torch.float8_e4m3fn)
    step = local.float() * second[..., None, None]
    x = groups / torch.where(step == 0, torch.ones_like(step), step)[..., None]
    table = torch.tensor(E2M1, dtype=torch.float32)
    code = (x.abs()[..., None] - table).abs().argmin(-1)
    code = (code | torch.where(x < 0, 8, 0)).reshape(*lead, rows, cols).to(torch.uint8)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), local.contiguous(), second.float()


# ------------------------------------------------------------------ one tensor in one layout

def _suffix(name: str, suffix: str) -> str:
    """The companion tensor name, as the runtime spells it (x.weight -> x.<suffix>)."""
    if name.endswith(".weight"):
        return name[:-len("weight")] + suffix
    return name + suffix[len("weight"):]


def encode(layout: str, name: str, w: torch.Tensor) -> tuple[dict, np.ndarray]:
    """(tensors to write for weight `name`, float64 reference values from those bytes)."""
    lead, rows, cols = w.shape[:-2], w.shape[-2], w.shape[-1]
    if layout.endswith("nvfp4"):
        packed, local, second = quantize_nvfp4(w)
        values = e2m1_values(packed.numpy()) * expand(e4m3_values(_bytes(local)), 1, 16, rows,
                                                      cols)
        if layout == "ct-nvfp4":
            glob = (1.0 / second).reshape(*lead, 1) if lead else (1.0 / second).reshape(1)
            ref = values / glob.double().numpy().reshape(*lead, 1, 1)
            return {_suffix(name, "weight_packed"): packed, _suffix(name, "weight_scale"): local,
                    _suffix(name, "weight_global_scale"): glob.float()}, ref
        ref = values * second.double().numpy().reshape(*lead, 1, 1)
        return {name: packed, _suffix(name, "weight_scale"): local,
                _suffix(name, "weight_scale_2"): second,
                _suffix(name, "input_scale"): torch.ones(lead)}, ref
    bn, bk = {"fp8-block": (128, 128), "ct-block": (128, 128), "ct-channel": (1, cols)}.get(
        layout, (rows, cols))
    q, scale = quantize_fp8(w, bn, bk)
    ref = e4m3_values(_bytes(q)) * expand(scale.double().numpy(), bn, bk, rows, cols)
    if layout == "fp8-block":
        return {name: q, _suffix(name, "weight_scale_inv"): scale}, ref
    if layout == "modelopt-fp8":
        scale = scale.reshape(lead)     # a scalar per matrix
        return {name: q, _suffix(name, "weight_scale"): scale,
                _suffix(name, "input_scale"): torch.ones(lead)}, ref
    if layout == "ct-tensor":
        scale = scale.reshape(*lead, 1) if lead else scale.reshape(1)
    return {name: q, _suffix(name, "weight_scale"): scale}, ref


def quantization_config(layout: str) -> tuple[dict | None, dict | None]:
    """(config.json quantization_config, hf_quant_config.json or None)."""
    ignore = ["lm_head", IGNORED]
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ignore}, None
    if layout == "modelopt-fp8":
        return None, {"producer": {"name": "modelopt"},
                      "quantization": {"quant_algo": "FP8", "exclude_modules": ignore}}
    if layout == "modelopt-nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ignore}, None
    if layout == "ct-nvfp4":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                   "symmetric": True, "dynamic": False}
        fmt = "nvfp4-pack-quantized"
    else:
        strategy = layout.split("-")[1]
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                   "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = [128, 128]
        fmt = "float-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ignore,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}, None


# ------------------------------------------------------------------ whole checkpoints

def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert modules -> transformers 5's fused 3-D tensors (gate_up [E, 2I, H])."""
    out, layers = {}, {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if m is None:
            out[name] = t
            continue
        layers.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, proj in layers.items():
        count = len(proj["gate"])
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([proj["gate"][e], proj["up"][e]]) for e in range(count)])
        out[prefix + ".down_proj"] = torch.stack([proj["down"][e] for e in range(count)])
    return out


def write_scaled(float_dir: Path, out: Path, layout: str, fused_experts: bool = False
                 ) -> tuple[Path, dict[str, np.ndarray]]:
    """Quantize the float checkpoint in `float_dir` into `out` (tokenizer and config copied,
    with the layout's quantization config); returns (out, reference float64 values of every
    quantized tensor by its name in `out`) and writes `out`/reference/: the same model with
    those reference values, for transformers to load."""
    out.mkdir(parents=True, exist_ok=True)
    with safe_open(str(float_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if fused_experts:
        tensors = _fuse_experts(tensors)
    written, refs, floats = {}, {}, {}
    for name, t in tensors.items():
        if LINEAR.search(name) and not name.startswith(IGNORED + "."):
            parts, ref = encode(layout, name, t.float())
            written.update(parts)
            refs[name] = ref
            floats[name] = torch.from_numpy(ref).float()
        else:
            written[name] = floats[name] = t
    save_file(written, str(out / "model.safetensors"))
    for extra in float_dir.iterdir():
        if extra.suffix != ".safetensors" and extra.is_file():
            shutil.copy(extra, out / extra.name)
    config = json.loads((float_dir / "config.json").read_text())
    quant, modelopt = quantization_config(layout)
    if quant is not None:
        config["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(config))
    if modelopt is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(modelopt))
    reference = out / "reference"
    reference.mkdir(exist_ok=True)
    for extra in float_dir.iterdir():
        if extra.suffix != ".safetensors" and extra.is_file():
            shutil.copy(extra, reference / extra.name)
    if fused_experts:    # transformers reads the per-expert layout it saved
        floats = {k: v for k, v in floats.items() if ".experts." not in k}
        with safe_open(str(float_dir / "model.safetensors"), "pt") as f:
            floats.update(_split_reference(refs, f))
    save_file({k: v.contiguous() for k, v in floats.items()}, str(reference / "model.safetensors"))
    return out, refs


def _split_reference(refs: dict[str, np.ndarray], f) -> dict[str, torch.Tensor]:
    """Fused 3-D reference values back to per-expert float tensors (names of the float file)."""
    out = {}
    for name, ref in refs.items():
        m = re.match(r"(.*\.experts)\.(gate_up|down)_proj$", name)
        if m is None:
            continue
        for e in range(ref.shape[0]):
            base = f"{m.group(1)}.{e}."
            value = torch.from_numpy(ref[e]).float()
            if m.group(2) == "down":
                out[base + "down_proj.weight"] = value
            else:
                half = value.shape[0] // 2
                out[base + "gate_proj.weight"] = value[:half]
                out[base + "up_proj.weight"] = value[half:]
    return out
