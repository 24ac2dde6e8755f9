"""Weight bytes from a checkpoint's tensor table (checkpoint/footprint.py), against bytes counted
independently: gguf's own reader over a tiny GGUF of Q4_K/Q6_K/Q8_0/Q5_0 tensors, the
safetensors headers of tiny FP8/NVFP4 checkpoints, and what the CPU loader really places.
On a GPU GGUF rows are padded to whole 16-byte words (Q6_K rows of 256 values: 210 -> 224)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.arrays import HostArrays
from freetoken.engine.config import EngineConfig
from freetoken.engine.memory_plan import GIB, ModelSizes
from freetoken.engine.offload_setup import OffloadConfig, OffloadPlanner
from freetoken.models.checkpoint.footprint import WeightBytes, weight_bytes
from freetoken.models.checkpoint.gguf import read_gguf
from freetoken.models.checkpoint.weights import Placement, build_decoder_weights
from freetoken.models.config import QuantWeight
from tests.kernel.gguf_random import random_blocks
from tests.models.helpers import tiny_hf_model
from tests.models.tiny_gguf import write_gguf

Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
GPU_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")   # a bf16 GPU keeps
SHAPE = dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


class FakeGPU:
    is_cpu = False

    def __str__(self) -> str:
        return "cuda:0"


def gpu_placement(dtype: str = "bfloat16") -> Placement:
    return Placement(SimpleNamespace(device=FakeGPU()), dtype)


def experts_in_blocks(monkeypatch, keep: bool) -> None:
    """Pin keeps_experts: GPU experts keep their blocks wherever keeps(qtype) says (keep), or
    are dequantized at load (not keep), whatever FREETOKEN_GGUF_GPU_EXPERTS says."""
    monkeypatch.setattr(Placement, "keeps_experts",
                        lambda self, qtype: keep and self.experts is None and self.keeps(qtype))


@pytest.fixture(scope="module")
def k_mix_gguf(tmp_path_factory):
    """A qwen3_moe GGUF like a _K_M file: Q4_K embedding, Q4_K gate/up and Q6_K down experts,
    Q8_0 projections, one Q5_0 projection (22-byte blocks), F32 norms and routers."""
    directory = tmp_path_factory.mktemp("footprint-gguf")
    hf = tiny_hf_model("qwen3_moe", directory, seed=3, **SHAPE)
    cfg, rng = hf.config, np.random.default_rng(0)
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    raw = {"token_embd.weight": (random_blocks(Q4_K, cfg.vocab_size, h, rng), Q4_K)}
    from gguf import GGMLQuantizationType, quants

    o_proj = rng.standard_normal((h, h)).astype(np.float32)
    raw["blk.1.attn_output.weight"] = (quants.quantize(o_proj, GGMLQuantizationType(Q5_0)),
                                       Q5_0)
    for i in range(cfg.num_hidden_layers):
        for part, qtype, rows, cols in (("gate", Q4_K, inter, h), ("up", Q4_K, inter, h),
                                        ("down", Q6_K, h, inter)):
            blocks = random_blocks(qtype, e * rows, cols, rng).reshape(e, rows, -1)
            raw[f"blk.{i}.ffn_{part}_exps.weight"] = (blocks, qtype)
    path = directory / "k-mix.gguf"
    write_gguf(hf, directory, path, "qwen3_moe", Q8_0, raw=raw)
    return path


def gpu_block_bytes(t) -> int:
    """A gguf ReaderTensor's blocks on a GPU: rows padded to whole 16-byte words."""
    rows = int(t.n_elements) // int(t.shape[0])          # shape[0] is ne0, the row length
    row_bytes = int(t.n_bytes) // rows
    return rows * (-(-row_bytes // 16) * 16)


def gguf_slot(path, experts: int) -> int:
    """An expert offload pool's slot for GGUF experts: the widest layer's expert (gate, up
    and down blocks, rows padded to 16 bytes) in 256-byte steps, by gguf's reader."""
    from gguf import GGUFReader

    layers: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if "_exps." in t.name:
            layer = t.name.split(".")[1]
            layers[layer] = layers.get(layer, 0) + gpu_block_bytes(t)
    widest = max(-(-b // experts) for b in layers.values())
    return -(-widest // 256) * 256


def gguf_expected(path) -> tuple[int, int, int]:
    """(other, expert blocks, expert floats) bytes on a bf16 GPU, by gguf's reader: block types
    the GPU kernels read at their file bytes (rows padded to 16 bytes), the rest at bf16."""
    from gguf import GGUFReader

    other = blocks = floats = 0
    for t in GGUFReader(str(path)).tensors:
        if "_exps." in t.name:
            blocks += gpu_block_bytes(t)
            floats += int(t.n_elements) * 2
        elif t.tensor_type.name in GPU_BLOCKS:
            other += gpu_block_bytes(t)
        else:
            other += int(t.n_elements) * 2
    return other, blocks, floats


def test_gguf_weights_count_their_blocks_on_a_gpu(k_mix_gguf, monkeypatch):
    other, blocks, floats = gguf_expected(k_mix_gguf)
    config, tensors, _ = read_gguf(k_mix_gguf)
    experts_in_blocks(monkeypatch, True)
    # the projections keep blocks too: prefill's dequantizing scratch is planned
    slot = gguf_slot(k_mix_gguf, config.moe.num_experts)
    assert weight_bytes(tensors, config, gpu_placement()) == WeightBytes(other, blocks, True,
                                                                         slot)
    experts_in_blocks(monkeypatch, False)
    assert weight_bytes(tensors, config, gpu_placement()) == WeightBytes(other, floats, True)
    # bf16 arithmetic would have counted about 3 times the blocks
    bf16 = ModelSizes.of(config, "bfloat16")
    assert bf16.other_weight_bytes > 1.5 * other
    assert bf16.expert_bytes * bf16.total_experts == floats > 2.5 * blocks


def test_gguf_on_a_float16_gpu_dequantizes_everything(k_mix_gguf):
    """The GPU kernels take bf16 activations: a float16 model keeps no blocks."""
    _, _, floats = gguf_expected(k_mix_gguf)
    config, tensors, _ = read_gguf(k_mix_gguf)
    from gguf import GGUFReader

    elements = sum(int(t.n_elements) for t in GGUFReader(str(k_mix_gguf)).tensors
                   if "_exps." not in t.name)
    assert weight_bytes(tensors, config, gpu_placement("float16")) == \
        WeightBytes(2 * elements, floats)


def test_the_gpu_plan_holds_the_file_bytes_not_bf16(k_mix_gguf, monkeypatch):
    """The start-up planner, fed what load_model hands it, plans the blocks' bytes: resident
    experts in blocks, an expert cache in slots of blocks (the widest layer's expert)."""
    other, blocks, _ = gguf_expected(k_mix_gguf)
    config, tensors, _ = read_gguf(k_mix_gguf)
    experts_in_blocks(monkeypatch, True)
    weights = weight_bytes(tensors, config, gpu_placement())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * GIB, 8 * GIB))
    engine = EngineConfig(num_tokens=1024, max_num_seqs=4, max_prefill_tokens=256)
    planner = OffloadPlanner(engine, OffloadConfig(), FakeGPU())
    assert planner(config, "bfloat16", weights) is False
    pools = planner.decision.plan.pools
    assert pools["weights"] == other and pools["experts"] == blocks
    planner = OffloadPlanner(engine, OffloadConfig(cache_rate=0.25), FakeGPU())
    assert planner(config, "bfloat16", weights) is True
    slot = gguf_slot(k_mix_gguf, config.moe.num_experts)
    assert slot < 3 * config.hidden_size * config.moe.intermediate_size * 2 / 2   # bf16: 2x
    experts = config.moe.num_experts
    slots = int(0.25 * experts * config.num_layers) + 2 * experts
    assert planner.decision.plan.pools["expert_cache"] == slots * slot


def placed_bytes(weights) -> int:
    """Bytes of every tensor build_decoder_weights placed (each object once)."""
    seen, total = set(), 0

    def walk(value) -> None:
        nonlocal total
        if isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif value is not None and id(value) not in seen:
            seen.add(id(value))
            total += int(value.data.nbytes if isinstance(value, QuantWeight) else value.nbytes)

    walk([weights.embed, weights.lm_head, weights.final_norm, weights.layers])
    return total


def test_cpu_weight_bytes_equal_what_the_loader_places(k_mix_gguf):
    """On the CPU every block type stays blocks and floats widen to float32: the footprint is
    the sum of what build_decoder_weights returns, and load_model hands it to its plan hook."""
    config, tensors, _ = read_gguf(k_mix_gguf)
    where = Placement(HostArrays(), "float32")
    counted = weight_bytes(tensors, config, where)
    placed = placed_bytes(build_decoder_weights(tensors, config, where))
    assert counted.other + counted.experts == placed
    from freetoken.models.loader import load_model

    seen = []
    load_model(str(k_mix_gguf), plan=lambda cfg, dtype, weights: seen.append(weights) or False)
    assert seen == [counted]


# ---- HF safetensors: FP8 / NVFP4 values and scales ------------------------------------------

SCALED = dict(hidden_size=192, head_dim=48, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=320, num_hidden_layers=3, mlp_only_layers=[1],
              moe_intermediate_size=160)


def safetensors_expected(directory, float_bytes: int = 2) -> tuple[WeightBytes, int]:
    """(bytes on a bf16 GPU, weights' elements) read off the file: FP8 values a byte each and
    their float32 grids; NVFP4 packed bytes, e4m3 scales and a float32 scale per row; floats at
    `float_bytes` (bf16)."""
    from safetensors import safe_open

    sizes, elements = {"other": 0, "experts": 0}, 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            if name.endswith("input_scale"):
                continue                 # activation scales: never read
            view = f.get_slice(name)
            shape, dtype = view.get_shape(), view.get_dtype()
            count = int(np.prod(shape))
            pool = "experts" if ".experts." in name else "other"
            is_nvfp4 = name.endswith("weight") and name[:-6] + "weight_scale_2" in names
            if name.endswith(("weight_scale", "weight_scale_2", "scale_inv")):
                if name.endswith("weight_scale_2"):
                    weight = f.get_slice(name[:-len("_scale_2")]).get_shape()
                    size = 4 * int(np.prod(weight[:-1]))     # one float32 a row
                else:
                    size = count * (4 if name.endswith("scale_inv") else 1)
                sizes[pool] += size
                continue
            values = 2 * count if is_nvfp4 else count      # two e2m1 values a byte
            elements += values
            if dtype in ("F8_E4M3", "U8"):
                sizes[pool] += count
            else:
                sizes[pool] += float_bytes * count
    return WeightBytes(sizes["other"], sizes["experts"]), elements


@pytest.mark.parametrize("arch,layout,fused", [("qwen3", "fp8-block", False),
                                               ("qwen3_moe", "fp8-block", True),
                                               ("qwen3_moe", "modelopt-nvfp4", False)])
def test_scaled_weights_count_values_and_scales(tmp_path, arch, layout, fused):
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.scaled_checkpoint import write_scaled

    settings = {k: v for k, v in SCALED.items()
                if arch == "qwen3_moe" or k not in ("mlp_only_layers", "moe_intermediate_size")}
    (tmp_path / "float").mkdir()
    tiny_hf_model(arch, tmp_path / "float", **settings)
    directory, _ = write_scaled(tmp_path / "float", tmp_path / layout, layout, fused)
    config, tensors, _, _ = read_hf_dir(directory)
    expected, elements = safetensors_expected(directory)
    if arch == "qwen3_moe" and layout == "fp8-block":     # FP8 experts: FP8 offload slots too
        expected = replace(expected, expert_slot=fp8_slot(expected.experts, config))
    if arch == "qwen3_moe" and layout == "modelopt-nvfp4":   # a slot: one expert as stored
        moe = config.moe
        expected = replace(expected, expert_slot=expected.experts // (
            moe.num_experts * sum(moe.sparse_layers)))
    assert weight_bytes(tensors, config, gpu_placement()) == expected
    cpu = weight_bytes(tensors, config, Placement(HostArrays(), "float32"))
    if layout == "modelopt-nvfp4":      # the CPU dequantizes NVFP4: float32 throughout
        assert cpu.other + cpu.experts == 4 * elements
    else:           # FP8 stays FP8 (values and grids), the rest is float32
        in_format, _ = safetensors_expected(directory, float_bytes=4)
        assert (cpu.other, cpu.experts) == (in_format.other, in_format.experts)
    # a float16 CPU model dequantizes FP8 too
    half = weight_bytes(tensors, config, Placement(HostArrays(), "float16"))
    assert half.other + half.experts == 2 * elements


def fp8_slot(expert_bytes: int, config) -> int:
    """One slot of the FP8 offload pool (engine/expert_pool.ScaledPool): an expert's values
    and scale grids (every layer's experts take the same bytes) and the float32 row scales
    the kernel reads, one per gate/up and down row (ones where the checkpoint has none)."""
    moe = config.moe
    per_expert = expert_bytes // (moe.num_experts * sum(moe.sparse_layers))
    return per_expert + 4 * (2 * moe.intermediate_size + config.hidden_size)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """(config, tensors, expected bytes) of a qwen3_moe in FP8 128x128 blocks (experts fused,
    as safetensors_expected counts their scales)."""
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.scaled_checkpoint import write_scaled

    base = tmp_path_factory.mktemp("footprint-fp8")
    (base / "float").mkdir()
    tiny_hf_model("qwen3_moe", base / "float", **SCALED)
    directory, _ = write_scaled(base / "float", base / "fp8", "fp8-block", fused_experts=True)
    config, tensors, _, _ = read_hf_dir(directory)
    return config, tensors, safetensors_expected(directory)[0]


def test_offloaded_fp8_experts_count_in_their_format(fp8_moe):
    """Offloaded FP8 experts stay FP8 (in host memory): the same bytes as resident ones, and
    the offload pool's slot is an FP8 expert's, well under a bf16 expert's."""
    config, tensors, expected = fp8_moe
    resident = weight_bytes(tensors, config, gpu_placement())
    offloaded = weight_bytes(tensors, config, replace(gpu_placement(), experts=HostArrays()))
    assert offloaded == resident
    assert resident.experts == expected.experts
    assert resident.expert_slot == fp8_slot(expected.experts, config)
    bf16_expert = 3 * config.hidden_size * config.moe.intermediate_size * 2
    assert resident.expert_slot < 0.6 * bf16_expert


def test_the_gpu_plan_counts_fp8_expert_slots(fp8_moe, monkeypatch):
    """The start-up planner, fed what load_model hands it, plans resident FP8 experts at their
    bytes and an expert cache (and its pinned host copy) in FP8 slots."""
    config, tensors, expected = fp8_moe
    weights = weight_bytes(tensors, config, gpu_placement())
    slot = fp8_slot(expected.experts, config)
    sizes = ModelSizes.of(config, "bfloat16", weights=weights)
    assert sizes.expert_slot_bytes == slot
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * GIB, 8 * GIB))
    engine = EngineConfig(num_tokens=1024, max_num_seqs=4, max_prefill_tokens=256)
    planner = OffloadPlanner(engine, OffloadConfig(), FakeGPU())
    assert planner(config, "bfloat16", weights) is False
    assert planner.decision.plan.pools["experts"] == expected.experts
    planner = OffloadPlanner(engine, OffloadConfig(cache_rate=0.25), FakeGPU())
    assert planner(config, "bfloat16", weights) is True
    experts = config.moe.num_experts
    slots = int(0.25 * experts * sum(config.moe.sparse_layers)) + 2 * experts
    assert planner.decision.plan.pools["expert_cache"] == slots * slot
    assert planner.decision.host_plan.pools["pinned_experts"] == sizes.total_experts * slot


def test_nvfp4_experts_count_in_format_on_a_gpu(tmp_path):
    """NVFP4 experts on a GPU count at their stored bytes (packed values, e4m3 scales, a float32
    row scale per row), resident or offloaded, and one offload slot is one expert's stored
    bytes; the CPU dequantizes them (float32, no slot)."""
    from freetoken.models.checkpoint.hf import read_hf_dir
    from tests.models.scaled_checkpoint import write_scaled

    (tmp_path / "float").mkdir()
    tiny_hf_model("qwen3_moe", tmp_path / "float", **SCALED)
    directory, _ = write_scaled(tmp_path / "float", tmp_path / "nvfp4", "modelopt-nvfp4")
    config, tensors, _, _ = read_hf_dir(directory)
    floats = weight_bytes(tensors, config, Placement(HostArrays(), "float32"))
    assert floats.expert_slot is None
    kept = weight_bytes(tensors, config, gpu_placement())
    assert kept.experts < floats.experts / 3
    moe = config.moe
    rows = 2 * moe.intermediate_size + config.hidden_size           # gate, up and down rows
    weights_per_expert = 3 * config.hidden_size * moe.intermediate_size
    per_expert = weights_per_expert // 2 + weights_per_expert // 16 + 4 * rows
    assert kept.experts == per_expert * moe.num_experts * sum(moe.sparse_layers)
    assert kept.expert_slot == per_expert
    assert weight_bytes(tensors, config, replace(gpu_placement(), experts=HostArrays())) == kept
