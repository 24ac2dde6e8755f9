"""The MoE decode step over GGUF experts (forward/moe_decode_quant.py), wired without a GPU: a
GGUF MoE model on a stand-in GPU placement (host torch tensors, the ops replaced by their torch
references, kernel/reference.py), each MoE layer's small-step decode against the same layer's
general path (the experts dequantized exactly, moe_experts). The two differ by the int8
rounding of the activations the decode kernels quantize (per 32 values, half a step of 1/127
of each group's largest value): a wrong slot, act row, routing weight or residual add is off by
O(100%). The kernels themselves are checked on CPU threads
(tests/kernel/test_gguf_gemv_q8_emulated.py) and on the GPU (tests/models/test_moe_gguf_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernel import ops, reference
from freetoken.models.forward import moe_decode_quant
from freetoken.models.forward.mlp import MoEMLP
from freetoken.models.loader import load_model
from tests.models.test_moe_gguf_gpu import fake_moe_gpu, k_mix_moe_file  # noqa: F401
from tests.models.test_gguf_gpu_plumbing import fake_gpu  # noqa: F401 (a fixture)

BF16 = torch.bfloat16
# int8 activations against exact ones: a few steps of 1/127 of a group's largest value,
# through two products (gate/up, then down)
REL_TOL = 0.03


@pytest.fixture
def q8_ops(fake_moe_gpu, monkeypatch):
    for name in ("decode_gemv", "moe_q8_gate_up", "moe_q8_down"):
        monkeypatch.setattr(ops, name, getattr(reference, name))


def _q8_0_shared_expert_file(tmp_path, tiny_checkpoint):
    """qwen2_moe (a sigmoid-gated shared expert beside the routed ones), Q8_0 experts."""
    from tests.models.tiny_gguf import write_gguf

    directory, hf = tiny_checkpoint("qwen2_moe")
    path = tmp_path / "qwen2-moe-q8.gguf"
    write_gguf(hf, directory, path, "qwen2_moe", 8, quantize_only=("_exps.weight",))
    return path, None


FILES = {"k-mix": lambda tmp_path, _: k_mix_moe_file(tmp_path),
         "q8_0-shared": _q8_0_shared_expert_file}


def _moe_layers(tmp_path, monkeypatch, file="k-mix", tiny_checkpoint=None):
    """(config, model, [(mlp, its QuantMoEDecode)]): the stand-in placement is not a real GPU,
    so attach() declines; each MoE layer gets its decode as attach() would give it."""
    from freetoken.models.forward import moe_decode

    seen = {}
    attach = moe_decode.attach

    def keep_weights(layers, weights, *args):
        seen["weights"] = weights
        return attach(layers, weights, *args)

    monkeypatch.setattr(moe_decode, "attach", keep_weights)
    path, _ = FILES[file](tmp_path, tiny_checkpoint)
    loaded = load_model(str(path), device="cuda")
    model, cfg = loaded.model, loaded.config
    pairs = []
    for layer, lw in zip(model.layers, seen["weights"]):
        if isinstance(layer.mlp, MoEMLP):
            assert layer.mlp.qtypes and layer.mlp.decode is None
            assert moe_decode_quant.eligible(cfg, layer.mlp, "bfloat16", _Cuda())
            pairs.append((layer.mlp, moe_decode_quant.QuantMoEDecode(layer.mlp, lw, cfg, 132,
                                                                     model.device)))
    assert pairs
    return cfg, model, pairs


class _Cuda:
    is_cpu = False


@pytest.mark.parametrize("tokens", (1, 2))
@pytest.mark.parametrize("file", FILES)
def test_decode_matches_the_layers_general_path(q8_ops, tmp_path, monkeypatch, tiny_checkpoint,
                                                file, tokens):
    cfg, model, pairs = _moe_layers(tmp_path, monkeypatch, file, tiny_checkpoint)
    g = torch.Generator().manual_seed(tokens)
    for mlp, decode in pairs:
        w = model._workspace.views(tokens)
        x = torch.randn(tokens, cfg.hidden_size, generator=g).to(BF16)
        want = mlp(x.clone(), w).float().clone()            # no decode attached: general path
        mlp.decode = decode
        assert mlp.decode_applies(tokens)
        assert not mlp.decode_applies(moe_decode_quant.MAX_TOKENS + 1)
        got = torch.full((tokens, cfg.hidden_size), float("nan"), dtype=BF16)
        decode(got, x, w, accumulate=False)
        scale = want.abs().max()
        assert (got.float() - want).abs().max() < REL_TOL * scale
        # the fused chain adds into the residual stream
        residual = torch.randn(tokens, cfg.hidden_size, generator=g).to(BF16)
        added = residual.clone()
        decode(added, x, w, accumulate=True)
        assert (added.float() - (residual.float() + want)).abs().max() < REL_TOL * scale
        # and the MLP call itself takes the decode path at this width
        assert torch.equal(mlp(x.clone(), w), got)


def test_an_unmapped_expert_adds_nothing(q8_ops, tmp_path, monkeypatch):
    cfg, model, pairs = _moe_layers(tmp_path, monkeypatch)
    mlp, decode = pairs[0]
    w = model._workspace.views(1)
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(BF16)
    full = torch.empty(1, cfg.hidden_size, dtype=BF16)
    decode(full, x, w, accumulate=False)
    kept = mlp.expert_map.clone()
    try:
        mlp.expert_map[:] = -1                     # no expert has a slot: nothing is added
        none = torch.full_like(full, float("nan"))
        decode(none, x, w, accumulate=False)
    finally:
        mlp.expert_map.copy_(kept)
    assert full.abs().max() > 0 and torch.equal(none, torch.zeros_like(none))
