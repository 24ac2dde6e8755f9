"""MoE models against HF transformers on tiny random checkpoints (8 experts, 2 per token).

qwen3_moe (norm_topk_prob, a dense layer from mlp_only_layers), qwen2_moe (shared expert with
its sigmoid gate, dense layers from decoder_sparse_step), mixtral (always renormalised) and
olmoe (q/k norms over the whole projections, softmax weights kept) run the engine's mixed
prefill/decode pattern; every step's logits must match transformers' float32 forward within
1e-4 and the greedy tokens must be the same. Expert layouts (per expert, fused gate_up_proj,
stacked 3-D) must load to the same model.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from freetoken.models.errors import MissingTensorError, UnsupportedModelError
from freetoken.models.loader import load_model
from tests.models.conftest import MOE_ARCHS
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.models.test_dense_hf import hf_last_logits, prompts, run_and_compare

SPARSE = {"qwen3_moe": (True, False, True), "qwen2_moe": (False, True, False, True),
          "mixtral": (True, True), "olmoe": (True, True)}


def hf_sparse_layers(hf) -> tuple[bool, ...]:
    return tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_forward_matches_transformers(arch, tiny_checkpoint, moe_ops):
    directory, hf = tiny_checkpoint(arch)
    loaded = load_model(str(directory), device="cpu")
    cfg = loaded.config
    assert cfg.architecture == arch
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2
    assert cfg.moe.sparse_layers == SPARSE[arch] == hf_sparse_layers(hf)
    assert cfg.moe.renormalize == (arch in ("qwen3_moe", "mixtral"))
    assert cfg.moe.shared_intermediate_size == (64 if arch == "qwen2_moe" else 0)
    assert cfg.qk_norm == {"qwen3_moe": "head", "olmoe": "full"}.get(arch)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    run_and_compare(loaded.model, hf)


def test_olmoe_qk_norm_spans_the_whole_projection(tiny_checkpoint):
    """olmoe's q/k norms have hidden (not head_dim) weights: a per-head norm would not load."""
    _, hf = tiny_checkpoint("olmoe")
    attn = hf.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (hf.config.hidden_size,)
    assert attn.k_norm.weight.shape == (hf.config.num_key_value_heads * 16,)


def _rewrite_experts(directory, target, layout: str, hf) -> None:
    """Copy a checkpoint with its experts stored as fused gate_up_proj or stacked 3-D tensors
    (transformers' own in-memory layout, and the other common one)."""
    from safetensors.torch import save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, target / name)
    state = {}
    for name, value in hf.state_dict().items():
        if layout == "stacked" and name.endswith("experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            base = name[: -len("gate_up_proj")]
            state[base + "gate_proj"], state[base + "up_proj"] = gate, up
        else:
            state[name] = value
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))


@pytest.mark.parametrize("layout", ["fused", "stacked"])
def test_expert_layouts_load_to_the_same_model(layout, tiny_checkpoint, moe_ops, tmp_path):
    directory, hf = tiny_checkpoint("qwen3_moe")
    _rewrite_experts(directory, tmp_path, layout, hf)
    loaded = load_model(str(tmp_path))
    a, _ = prompts(loaded.config.vocab_size)
    assert_logits_close(PagedRunner(loaded.model).step([(0, a)])[0],
                        hf_last_logits(hf, a), loaded.config)


def test_missing_experts_are_refused_naming_every_layout(tiny_checkpoint, tmp_path):
    from safetensors.torch import save_file

    directory, hf = tiny_checkpoint("mixtral")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, tmp_path / name)
    state = {k: v for k, v in hf.state_dict().items() if ".experts." not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError) as err:
        load_model(str(tmp_path))
    message = str(err.value)
    for expected in ("model.layers.0.mlp.experts.gate_up_proj",
                     "model.layers.0.mlp.experts.gate_proj",
                     "model.layers.0.mlp.experts.{0..7}.w1.weight"):
        assert expected in message


@pytest.mark.parametrize("method", ["awq", "made_up_method"])
def test_quantization_config_is_refused_by_method(method, tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("qwen3_moe")
    copy = shutil.copytree(directory, tmp_path / "model")
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [128, 128]}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=f"quant_method '{method}' is not supported"):
        load_model(str(copy))


def test_active_parameters_count_only_the_routed_experts(tiny_checkpoint, moe_ops):
    directory, hf = tiny_checkpoint("qwen2_moe")
    cfg = load_model(str(directory)).config
    expert = 3 * cfg.hidden_size * cfg.moe.intermediate_size
    idle = sum(cfg.moe.sparse_layers) * (cfg.moe.num_experts - cfg.moe.top_k) * expert
    assert cfg.active_params_per_token == sum(p.numel() for p in hf.parameters()) - idle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load(dtype, tiny_checkpoint, moe_ops, tmp_path):
    """bf16/fp16 safetensors: the CPU computes in float32 on exactly the stored values."""
    directory, hf = tiny_checkpoint("qwen2_moe")
    half = type(hf)(hf.config).eval()
    half.load_state_dict(hf.state_dict())
    half.to(dtype).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, tmp_path / name)
    # a fresh float32 model: converting `half` back would keep its bf16-rounded rope buffers
    reference = type(hf)(hf.config).eval()
    reference.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    loaded = load_model(str(tmp_path))
    a, _ = prompts(loaded.config.vocab_size)
    assert_logits_close(PagedRunner(loaded.model).step([(0, a)])[0],
                        hf_last_logits(reference, a), loaded.config)
