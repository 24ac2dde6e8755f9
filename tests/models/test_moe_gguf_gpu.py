"""MoE GGUF files on the GPU with their routed experts kept in VRAM (moe_experts_gguf).

A Q4_K_M-like file (Q4_K gate/up experts, Q6_K down experts: random valid zero-mean blocks,
since gguf's quantizer has no K-quants) on the GPU against the same file with its experts dequantized to
bf16 at load (the float experts kernel; every other tensor identical), and a Q8_0-expert file
on the GPU against the CPU's quantized experts kernel. The comparisons are those of
test_gguf_gpu.py (5% of the largest logit; a wrong block decode is off by O(100%)). The first
test runs here too, on the CPU, through the torch references (the loader, the placement and
MoEMLP's GPU branch), with gguf's numpy dequantizer behind moe_experts_gguf.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.kernel import ops, reference
from freetoken.models import loader
from freetoken.models.checkpoint.weights import Placement, gpu_rows
from freetoken.models.forward.moe_decode_quant import QuantMoEDecode
from freetoken.models.loader import load_model
from tests.kernel.gguf_random import dequantize, random_blocks
from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.models.test_gguf_gpu import _compare
from tests.models.test_gguf_gpu_plumbing import fake_gpu  # noqa: F401 (a fixture)
from tests.models.tiny_gguf import write_gguf

needs_gpu = [pytest.mark.gpu,
             pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
Q8_0, Q4_K, Q6_K = 8, 12, 14
# Expert matrices of whole K-quant blocks (256 weights) on both of their axes.
# Expert weights of about 0.05 * EXPERT_SIZE, so that the experts dominate the logits: through
# the references on the CPU, gate and up swapped move them by 150% of the largest logit, exact
# f32 expert weights against bf16-rounded ones (the GEMV path against the reference) by 1.8%.
EXPERT_SIZE = 8.0
SHAPE = dict(hidden_size=256, moe_intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def k_mix_moe_file(tmp_path) -> tuple:
    """(path, raw expert blocks by GGUF name): qwen3_moe, 8 experts, 2 per token."""
    hf = tiny_hf_model("qwen3_moe", tmp_path, seed=4, **SHAPE)
    cfg, rng = hf.config, np.random.default_rng(0)
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    raw = {}
    for i in range(cfg.num_hidden_layers):
        for part, qtype, rows, cols in (("gate", Q4_K, inter, h), ("up", Q4_K, inter, h),
                                        ("down", Q6_K, h, inter)):
            blocks = random_blocks(qtype, e * rows, cols, rng, EXPERT_SIZE,
                                   centered=True).reshape(e, rows, -1)
            raw[f"blk.{i}.ffn_{part}_exps.weight"] = (blocks, qtype)
    path = tmp_path / "moe-k-mix.gguf"
    write_gguf(hf, tmp_path, path, "qwen3_moe", None, raw=raw)
    return path, raw


def _experts_dequantized(monkeypatch) -> None:
    """Loads after this dequantize GGUF experts at load (the float experts kernel's input)."""
    monkeypatch.setattr(Placement, "keeps_experts", lambda self, qtype: False)


def _check_placement(model, raw: dict, on_gpu: bool) -> None:
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        assert mlp.qtypes == (Q4_K, Q6_K)
        w13, w2 = mlp.w13, mlp.w2
        assert w13.dtype == w2.dtype == torch.uint8 and w13.is_cuda == on_gpu
        gate, up = raw[f"blk.{i}.ffn_gate_exps.weight"][0], raw[f"blk.{i}.ffn_up_exps.weight"][0]
        # the file's blocks, nothing more: rows padded to whole 16-byte words (Q6_K rows of
        # I = 256 weights are 210 bytes, kept as 224)
        expected = gpu_rows(np.concatenate([gate, up], axis=1))   # gate rows, then up rows
        assert w13.nbytes == expected.nbytes and np.array_equal(w13.cpu().numpy(), expected)
        down = raw[f"blk.{i}.ffn_down_exps.weight"][0]
        assert w2.shape[-1] == -(-down.shape[-1] // 16) * 16
        assert np.array_equal(w2.cpu().numpy()[..., :down.shape[-1]], down)
        assert not w2.cpu().numpy()[..., down.shape[-1]:].any()


def _fake_moe_experts_gguf(out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights,
                           expert_map, workspace):
    def floats(w, qtype):
        values = dequantize(w.numpy().reshape(-1, w.shape[-1]), qtype)
        return torch.from_numpy(values).reshape(*w.shape[:-1], -1).to(x.dtype)

    reference.moe_experts(out, x, floats(w13, qtype13), floats(w2, qtype2), topk_ids,
                          topk_weights, expert_map, workspace)


def test_gpu_experts_stay_in_their_blocks(fake_moe_gpu, tmp_path):
    path, raw = k_mix_moe_file(tmp_path)
    mlp = load_model(str(path), device="cuda").model.layers[0].mlp
    assert mlp.qtypes == (Q4_K, Q6_K) and mlp.w13.dtype == torch.uint8


@pytest.fixture
def fake_moe_gpu(fake_gpu, monkeypatch):
    for name in ("moe_topk_softmax", "moe_experts"):
        monkeypatch.setattr(ops, name, getattr(reference, name))
    monkeypatch.setattr(ops, "moe_experts_gguf", _fake_moe_experts_gguf)


def test_plumbing_experts_stay_quantized_on_a_gpu_placement(fake_moe_gpu, monkeypatch,
                                                            tmp_path):
    path, raw = k_mix_moe_file(tmp_path)
    quant = load_model(str(path), device="cuda")
    _check_placement(quant.model, raw, on_gpu=False)       # the fake GPU keeps host tensors
    _experts_dequantized(monkeypatch)
    floats = load_model(str(path), device="cuda")
    assert not floats.model.layers[0].mlp.qtypes
    prompt = list(range(3, 40))
    a = PagedRunner(quant.model).step([(0, prompt)])[0].float()
    b = PagedRunner(floats.model).step([(0, prompt)])[0].float()
    # the same bf16 model but for bf16-rounded expert weights in b
    assert (a - b).abs().max() < 0.05 * b.abs().max()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_plumbing_other_gpu_dtypes_dequantize_experts_at_load(fake_moe_gpu, tmp_path, dtype):
    path, _ = k_mix_moe_file(tmp_path)
    loaded = loader.load_model(str(path), device="cuda", dtype=dtype)
    mlp = loaded.model.layers[0].mlp
    assert not mlp.qtypes and mlp.w13.dtype == getattr(torch, dtype)


def gpu_test(fn):
    for mark in needs_gpu:
        fn = mark(fn)
    return fn


@gpu_test
def test_k_mix_experts_stay_in_vram_and_match_the_dequantized_experts(monkeypatch, tmp_path):
    path, raw = k_mix_moe_file(tmp_path)
    gpu = load_model(str(path), device="cuda")
    _check_placement(gpu.model, raw, on_gpu=True)
    # decode steps of 1-2 tokens take the int8 MoE decode kernels (moe_decode_quant.py)
    assert all(isinstance(layer.mlp.decode, QuantMoEDecode) for layer in gpu.model.layers)
    _experts_dequantized(monkeypatch)
    reference_model = load_model(str(path), device="cuda")
    assert not reference_model.model.layers[0].mlp.qtypes
    _compare(gpu.model, reference_model.model, gpu.config.vocab_size)


@gpu_test
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_q8_0_experts_on_the_gpu_match_the_cpu(arch, tmp_path):
    # head_dim 64: the GPU's attention kernels take 64, 128 and 256. Mixtral routes every
    # token to all its experts: this tiny model's router logits are ~100 with second and third
    # experts as close as 0.15 over the prompt, inside bf16's rounding of them, and a second
    # expert swapped between the bf16 GPU and the float32 CPU moves later logits by O(1)
    # (top-k selection itself: the kernel tests)
    sizes = {"qwen2_moe": dict(num_hidden_layers=4, decoder_sparse_step=2,
                               moe_intermediate_size=64, shared_expert_intermediate_size=128),
             "mixtral": dict(intermediate_size=64, num_local_experts=4,
                             num_experts_per_tok=4)}[arch]
    hf = tiny_hf_model(arch, tmp_path, seed=6, hidden_size=256, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, **sizes)
    path = tmp_path / f"{arch}-q8.gguf"
    write_gguf(hf, tmp_path, path, arch, Q8_0, quantize_only=("_exps.weight",))
    gpu, cpu = load_model(str(path), device="cuda"), load_model(str(path))
    sparse = [layer.mlp for layer in gpu.model.layers if getattr(layer.mlp, "qtypes", None)]
    assert sparse and all(m.qtypes == (Q8_0, Q8_0) and m.w13.is_cuda for m in sparse)
    _compare(gpu.model, cpu.model, gpu.config.vocab_size)


@gpu_test
def test_k_mix_moe_decode_in_cuda_graphs_gives_the_eager_tokens(tmp_path):
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams

    path, _ = k_mix_moe_file(tmp_path)
    loaded = load_model(str(path), device="cuda")
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = PagedRunner(loaded.model, num_blocks=64, block_size=16)
    logits, eager = runner.step([(0, prompt)])[0], []
    for _ in range(12):
        eager.append(int(logits.argmax()))
        logits = runner.step([(0, eager[-1:])])[0]
    engine = Engine.from_loaded(loaded, EngineConfig(num_tokens=4096, max_num_seqs=8,
                                                     device="cuda")).start()

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        return [t async for out in engine.generate(prompt, params) for t in out.token_ids]

    try:
        assert engine.graphs is not None
        assert asyncio.run(run()) == eager
    finally:
        engine.shutdown()
