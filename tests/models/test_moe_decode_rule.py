"""The small-step MoE decode path's host logic, no GPU needed: which layers the load-time rule
admits (forward/moe_decode.py's module doc) and which steps take the path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken.models.forward import moe_decode
from freetoken.models.forward.mlp import MoEMLP

GPU = SimpleNamespace(is_cpu=False)
H, E, INTER, K = 64, 8, 32, 2


def _layer(dtype=torch.bfloat16, shared=0, top_k=K, experts=E, hidden=H, inter=INTER):
    cfg = SimpleNamespace(hidden_size=hidden,
                          moe=SimpleNamespace(top_k=top_k, num_experts=experts,
                                              renormalize=True))
    w = {"router": torch.zeros(experts, hidden, dtype=dtype)}
    mlp = SimpleNamespace(scaled=None, qtypes=(), shared=None,
                          w13=torch.zeros(experts, 2 * inter, hidden, dtype=dtype),
                          w2=torch.zeros(experts, hidden, inter, dtype=dtype))
    if shared:
        mlp.shared = object()
        w["shared.gate_up"] = [torch.zeros(2 * shared, hidden, dtype=dtype)]
        w["shared.down"] = torch.zeros(hidden, shared, dtype=dtype)
    return cfg, mlp, w


@pytest.fixture(autouse=True)
def moe_decode_on(monkeypatch):
    """The path is on by default (FREETOKEN_MOE_DECODE); these tests are about its rule."""
    monkeypatch.setenv("FREETOKEN_MOE_DECODE", "1")


def test_on_unless_turned_off(monkeypatch):
    from freetoken import env

    monkeypatch.delenv("FREETOKEN_MOE_DECODE")
    assert env.read().moe_decode is True
    monkeypatch.setenv("FREETOKEN_MOE_DECODE", "0")
    assert env.read().moe_decode is False


def test_plain_bf16_and_f16_layers_qualify():
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        cfg, mlp, w = _layer(dtype, shared=16)
        assert moe_decode.eligible(cfg, mlp, w, name, GPU)


@pytest.mark.parametrize("change", ["cpu", "float32", "gguf", "scaled", "top_k", "experts",
                                    "hidden", "inter", "strided", "dtype_mix", "split_shared",
                                    "env", "moe_env"])
def test_what_keeps_the_general_path(change, monkeypatch):
    cfg, mlp, w = _layer(shared=16)
    device, dtype = GPU, "bfloat16"
    if change == "cpu":
        device = SimpleNamespace(is_cpu=True)
    elif change == "float32":
        cfg, mlp, w = _layer(torch.float32)
        dtype = "float32"
    elif change == "gguf":
        mlp.qtypes = (2, 2)
    elif change == "scaled":
        mlp.scaled = object()
    elif change == "top_k":
        cfg, mlp, w = _layer(top_k=moe_decode.MAX_TOP_K + 1)
    elif change == "experts":
        cfg.moe.num_experts = moe_decode.MAX_EXPERTS + 1
    elif change == "hidden":
        cfg, mlp, w = _layer(hidden=H + 4)
    elif change == "inter":
        cfg, mlp, w = _layer(inter=INTER + 4)
    elif change == "strided":
        mlp.w2 = mlp.w2.transpose(1, 2)
    elif change == "dtype_mix":
        w["router"] = w["router"].float()
    elif change == "split_shared":      # fused rows the loader could not concatenate
        w["shared.gate_up"] = [torch.zeros(16, H, dtype=torch.bfloat16)] * 2
    elif change == "env":
        monkeypatch.setenv("FREETOKEN_FUSED_DECODE", "0")
    elif change == "moe_env":
        monkeypatch.setenv("FREETOKEN_MOE_DECODE", "0")
    assert not moe_decode.eligible(cfg, mlp, w, dtype, device)


def test_steps_that_take_the_path():
    mlp = MoEMLP.__new__(MoEMLP)
    mlp.decode, mlp.offload = SimpleNamespace(max_tokens=2), None
    assert mlp.decode_applies(1) and mlp.decode_applies(2)
    assert not mlp.decode_applies(3)
    mlp.offload = object()           # the expert cache's slot bookkeeping runs on the host
    assert not mlp.decode_applies(1)
    mlp.decode, mlp.offload = None, None
    assert not mlp.decode_applies(1)


@pytest.mark.parametrize("inter,widest", [(512, 2), (640, 2), (768, 1), (1408, 1)])
def test_widest_step_follows_the_expert_width(inter, widest):
    """The H200 rule: one token always, two only for narrow experts (Qwen3.6's 512, not
    Qwen3-30B's 768), never more (moe_experts wins from 4 tokens on)."""
    assert moe_decode.max_tokens(inter) == widest <= moe_decode.MAX_TOKENS


def test_host_arrays_get_no_decode_path():
    """A GPU placement stood in by host tensors (as in the CPU tests) attaches nothing."""
    cfg, mlp, w = _layer()
    layer = SimpleNamespace(mlp=MoEMLP.__new__(MoEMLP))
    layer.mlp.__dict__.update(vars(mlp), decode=None, offload=None)
    arrays = SimpleNamespace(device=GPU, torch_device=torch.device("cpu"))
    assert moe_decode.attach([layer], [w], cfg, "bfloat16", arrays) == 0
    assert layer.mlp.decode is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "olmoe-1b-7b"])
def test_models_decode_through_the_path(name, tmp_path, monkeypatch):
    """Real MoE shapes load with the path on every MoE layer (fused layers and unfused alike),
    a decode step of 1 sequence runs it; one of 6 sequences and a 20-token prefill do not
    (experts of these shapes are wider than NARROW_INTER: 1-token steps only)."""
    from freetoken.models.loader import load_model
    from tests.models.helpers import PagedRunner, tiny_hf_model
    from tests.models.test_gpu_vs_hf import SHAPES

    arch, shape = SHAPES[name]
    tiny_hf_model(arch, tmp_path, seed=5, **dict(shape, num_hidden_layers=1))
    loaded = load_model(str(tmp_path), device="cuda")
    mlps = [layer.mlp for layer in loaded.model.layers if isinstance(layer.mlp, MoEMLP)]
    assert mlps and all(m.decode is not None for m in mlps)
    calls = []

    class Spy:   # records each call's token count; keeps the attributes the rule reads
        def __init__(self, real):
            self.real, self.max_tokens = real, real.max_tokens

        def __call__(self, *a, **k):
            calls.append(a[1].shape[0])
            return self.real(*a, **k)

    for m in mlps:
        monkeypatch.setattr(m, "decode", Spy(m.decode))
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16)
    prompts = [(s, list(range(3 + s, 23 + s))) for s in range(6)]
    runner.step(prompts[:1])
    assert calls == []                       # 20 prompt tokens: the general kernels
    first = runner.step([(0, [7])])[0]
    assert calls == [1] * len(mlps) and torch.isfinite(first).all()
    runner.step(prompts[1:])
    calls.clear()
    assert all(m.decode.max_tokens == 1 for m in mlps)
    runner.step([(s, [9]) for s in range(6)])
    assert calls == []
