"""The hybrid Gated DeltaNet models (qwen3_next, qwen3_5_moe) against HF transformers on tiny
random float32 checkpoints: three GDN layers and one gated full-attention layer, 8 experts
(2 per token) with a shared expert. Two sequences of different lengths run the engine's mixed
prefill-chunk / decode pattern (run_and_compare): every step's logits must match transformers
within the float32 rounding bound and the greedy tokens must be the same.
"""

from __future__ import annotations

import json

import pytest
import torch

from freetoken.models.loader import load_model
from tests.models.helpers import _perturb, write_byte_bpe
from tests.models.test_dense_hf import run_and_compare

COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-3,
              tie_word_embeddings=False, eos_token_id=2, bos_token_id=None,
              linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48)
SETTINGS = {
    # a dense MLP in layer 1 (mlp_only_layers); the pattern from full_attention_interval
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True,
                        full_attention_interval=4)),
    # an explicit layer_types with the full-attention layer in the middle
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(layer_types=["linear_attention", "full_attention",
                                      "linear_attention", "linear_attention"])),
}


def build_hybrid(arch: str, directory, seed: int = 0, **overrides):
    """Save a random float32 model of `arch` with a tokenizer; return the HF model."""
    import transformers

    config_name, model_name, extra = SETTINGS[arch]
    vocab = write_byte_bpe(directory)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(vocab_size=vocab,
                                                **{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    _perturb(model, seed)
    with torch.no_grad():   # a conv that matters, and decays spread over (0, 1)
        for name, p in model.named_parameters():
            if name.endswith("conv1d.weight"):
                p.mul_(6.0)
            elif name.endswith("A_log"):
                p.copy_(torch.linspace(-2.0, 1.0, p.numel()))
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    built = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{arch}")
            built[arch] = (directory, build_hybrid(arch, directory))
        return built[arch]

    return get


def float64_reference(hf):
    """A float64 copy of `hf` (its experts through the eager loop: grouped_mm has no float64)."""
    import copy

    reference = copy.deepcopy(hf)
    reference.set_experts_implementation("eager")
    return reference.double()


@pytest.mark.parametrize("arch", sorted(SETTINGS))
def test_hybrid_forward_matches_transformers(arch, hybrid_checkpoint, moe_ops):
    directory, hf = hybrid_checkpoint(arch)
    loaded = load_model(str(directory), device="cpu")
    cfg = loaded.config
    assert cfg.architecture == arch
    assert cfg.linear_layers == tuple(t == "linear_attention" for t in hf.config.layer_types)
    assert cfg.rope_dim == 4      # partial_rotary_factor 0.25 of head_dim 16
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    run_and_compare(loaded.model, float64_reference(hf))


def test_multimodal_checkpoint_layout_loads_the_text_model(hybrid_checkpoint, moe_ops,
                                                           tmp_path):
    """Qwen3.5/3.6 as published: config.json nests text_config, the text weights sit under
    model.language_model. (the vision tower is tested in test_vision_*.py)."""
    from safetensors.torch import save_file

    from tests.models.test_dense_hf import hf_last_logits, prompts
    from tests.models.helpers import PagedRunner, assert_logits_close

    directory, hf = hybrid_checkpoint("qwen3_5_moe")
    text = json.loads((directory / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
             "tie_word_embeddings": False, "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    state = {k.replace("model.", "model.language_model.", 1): v.contiguous()
             for k, v in hf.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_model(str(tmp_path))
    assert loaded.config.architecture == "qwen3_5_moe"
    a, _ = prompts(loaded.config.vocab_size)
    assert_logits_close(PagedRunner(loaded.model).step([(0, a)])[0],
                        hf_last_logits(float64_reference(hf), a), loaded.config)
