"""Refusals before anything loads (--tensor-parallel-size, --gpus, shapes that do not split,
options TP does not support), and the slicing rules against plain numpy slices."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

from freetoken.cli.main import main
from freetoken.models.config import ModelConfig, MoEConfig, QuantWeight
from freetoken.parallel.options import ParallelOptionError, resolve_parallel
from freetoken.parallel.shard import (Shard, ShardedSource, ShardError, check_shardable,
                                      local_config)
from tests.models.helpers import tiny_hf_model

BASE = ModelConfig(architecture="qwen3", vocab_size=301, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_theta=1e4, max_position=256)


def two_gpus() -> int:
    return 2


@pytest.mark.parametrize("size,gpus,device,fragment", [
    ("0", None, "cpu", "must be at least 1"),
    ("two", None, "cpu", "is not an integer"),
    ("2", "0,x", "cuda", "'x' is not a GPU id"),
    ("2", "1,1", "cuda", "names GPU 1 more than once"),
    ("2", "0", "cuda", "lists 1 GPU(s) but --tensor-parallel-size is 2"),
    ("2", "0,5", "cuda", "GPU 5 is not present (ids 0..1)"),
    ("3", None, "cuda", "needs 3 GPUs from 0 but 2 are present"),
    ("2", "0,1", "cpu", "--gpus needs a GPU device"),
])
def test_bad_options_are_refused_with_the_reason(size, gpus, device, fragment):
    with pytest.raises(ParallelOptionError, match=".*") as info:
        resolve_parallel(size, gpus, device, count=two_gpus)
    assert fragment in str(info.value)


def test_good_options_give_one_device_per_rank():
    assert resolve_parallel("2", "1,0", "cuda", count=two_gpus).devices == ("cuda:1", "cuda:0")
    assert resolve_parallel("2", None, "auto", count=two_gpus).devices == ("cuda:0", "cuda:1")
    assert resolve_parallel("2", None, "auto", count=lambda: 0).devices == ("cpu", "cpu")


@pytest.mark.parametrize("change,size,fragment", [
    ({}, 3, "does not divide the 4 attention heads"),
    ({"num_heads": 8, "num_kv_heads": 3}, 2, "neither divides the 3 KV heads"),
    ({"intermediate_size": 130}, 4, "does not divide the MLP width 130"),
    ({"moe": MoEConfig(8, 2, 30, True, sparse_layers=(True, True))}, 4,
     "does not divide the expert width 30"),
    ({"qk_norm": "full"}, 2, "needs every head on one rank"),
])
def test_shapes_that_do_not_split_are_refused(change, size, fragment):
    with pytest.raises(ShardError) as info:
        check_shardable(dataclasses.replace(BASE, **change), size)
    assert fragment in str(info.value)


def test_fewer_kv_heads_than_ranks_are_replicated():
    cfg = dataclasses.replace(BASE, num_heads=8, num_kv_heads=2)
    check_shardable(cfg, 4)
    local = local_config(cfg, 4)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (2, 1, 76)


class Source:
    source = "mem"

    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name):
        return self.tensors.get(name)

    def file_name(self, name):
        return name


def test_slices_are_the_ranks_rows_and_columns():
    cfg = dataclasses.replace(BASE, num_kv_heads=1,
                              moe=MoEConfig(8, 2, 128, True, sparse_layers=(True, True)))
    rng = np.random.default_rng(0)
    q, k, o = (rng.standard_normal(s).astype(np.float32)
               for s in ((64, 64), (16, 64), (64, 64)))
    embed = rng.standard_normal((301, 64)).astype(np.float32)
    experts = rng.standard_normal((8, 64, 128)).astype(np.float32)
    src = Source({"layers.0.q": q, "layers.0.k": k, "layers.0.o": o, "embed": embed,
                  "layers.0.experts.down": experts, "layers.0.input_norm": q[0]})
    for rank in range(2):
        shard = ShardedSource(src, cfg, Shard(rank, 2))
        np.testing.assert_array_equal(shard.get("layers.0.q"), q[32 * rank:32 * rank + 32])
        np.testing.assert_array_equal(shard.get("layers.0.k"), k)          # replicated head
        np.testing.assert_array_equal(shard.get("layers.0.o"), o[:, 32 * rank:32 * rank + 32])
        np.testing.assert_array_equal(shard.get("layers.0.experts.down"),
                                      experts[:, :, 64 * rank:64 * rank + 64])
        np.testing.assert_array_equal(shard.get("layers.0.input_norm"), q[0])
        rows = shard.get("embed")
        assert rows.shape == (151, 64)
        np.testing.assert_array_equal(rows[:301 - 151 * rank], embed[151 * rank:151 * rank + 151])
    np.testing.assert_array_equal(rows[150:], 0)    # rank 1's padding row


def test_gguf_blocks_split_by_whole_blocks_or_are_refused():
    from gguf import GGMLQuantizationType, quants

    from freetoken.models.errors import UnsupportedModelError

    rng = np.random.default_rng(1)
    o = rng.standard_normal((64, 64)).astype(np.float32)
    blocks = quants.quantize(o, GGMLQuantizationType.Q8_0)
    full = quants.dequantize(blocks, GGMLQuantizationType.Q8_0)
    src = Source({"layers.0.o": QuantWeight(8, blocks, (64, 64))})
    part = ShardedSource(src, BASE, Shard(1, 2)).get("layers.0.o")
    assert part.shape == (64, 32)
    np.testing.assert_array_equal(
        quants.dequantize(part.data, GGMLQuantizationType.Q8_0), full[:, 32:])
    narrow = dataclasses.replace(BASE, num_heads=8, head_dim=8, num_kv_heads=8)
    with pytest.raises(UnsupportedModelError, match="do not split at column 16"):
        ShardedSource(src, narrow, Shard(1, 4)).get("layers.0.o")


def test_serve_refuses_before_loading(tmp_path):
    tiny_hf_model("qwen3", tmp_path)
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--device", "cpu",
                                       "--port", "0", "-tp", "3"])
    assert result.exit_code != 0
    assert "--tensor-parallel-size 3 does not divide the 4 attention heads" in result.output
    assert "rank 1 started" not in result.output
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--device", "cpu",
                                       "-tp", "2", "--moe-cache-rate", "0.5"])
    assert result.exit_code != 0 and "--moe-cache-rate below 1" in result.output


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_safetensors_slices_read_alone_equal_slices_of_whole_tensors(arch, tmp_path):
    from freetoken.models.checkpoint.hf import read_hf_dir

    tiny_hf_model(arch, tmp_path, seed=4)
    config, tensors, _, _ = read_hf_dir(tmp_path)
    names = ["layers.0.q", "layers.1.o", "embed", "lm_head"]
    names += (["layers.0.experts.gate", "layers.0.experts.up", "layers.1.experts.down"]
              if arch == "qwen3_moe" else ["layers.0.up", "layers.1.down"])
    for rank in range(2):
        whole = ShardedSource(Source({n: tensors.get(n) for n in names}), config,
                              Shard(rank, 2))
        alone = ShardedSource(tensors, config, Shard(rank, 2))
        for name in names:
            np.testing.assert_array_equal(alone.get(name).numpy(), whole.get(name).numpy(),
                                          err_msg=name)
    for name in names[:2] + names[4:]:      # these were read as slices, not whole
        ndim = 3 if ".experts." in name else 2
        assert tensors.get_part(name, ndim - 1, 0, 16) is not None, name


def test_fused_expert_layout_slices_equal_the_per_expert_ones(tmp_path):
    """transformers 5 writes experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from freetoken.models.checkpoint.hf import read_hf_dir

    per_expert, fused = tmp_path / "per-expert", tmp_path / "fused"
    per_expert.mkdir()
    tiny_hf_model("qwen3_moe", per_expert, seed=6)
    shutil.copytree(per_expert, fused)
    state = load_file(str(per_expert / "model.safetensors"))
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        stack = {proj: torch.stack([state.pop(f"{p}{e}.{proj}_proj.weight") for e in range(8)])
                 for proj in ("gate", "up", "down")}
        state[p + "gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
        state[p + "down_proj"] = stack["down"]
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (a_cfg, a, _, _), (_, b, _, _) = read_hf_dir(per_expert), read_hf_dir(fused)
    for rank in range(2):
        for name in ("layers.0.experts.gate", "layers.0.experts.up", "layers.1.experts.down"):
            ours = ShardedSource(b, a_cfg, Shard(rank, 2)).get(name)
            expected = ShardedSource(a, a_cfg, Shard(rank, 2)).get(name)
            np.testing.assert_array_equal(ours.numpy(), expected.numpy(), err_msg=name)
    assert b.get_part("layers.0.experts.up", 2, 0, 32) is not None
