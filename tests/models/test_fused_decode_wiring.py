"""The fused decode step's wiring (forward/fused_decode.py), runnable without a GPU: every op,
fused or not, is replaced by its plain-torch reference (kernel/reference.py), the model is
built on torch CPU tensors, and the fused layers are put in place as the GPU load would.
Their logits must match transformers' float32 forward as closely as the unfused step's do;
a wrong buffer, norm weight or residual add is off by O(1). The kernels themselves are checked
against the same references on the GPU (tests/kernel/test_decode_fused_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.arrays import TorchArrays, parse_device
from freetoken.kernel import ops, reference
from freetoken.models.checkpoint.hf import read_hf_dir
from freetoken.models.checkpoint.weights import Placement, build_decoder_weights
from freetoken.models.forward import fused_decode
from freetoken.models.config import QuantWeight
from freetoken.models.forward.decoder import _MOE_OPS, _OPS, Decoder
from tests.models.helpers import PagedRunner, assert_logits_close, tiny_hf_model

FUSED_OPS = ("decode_gemv", "decode_gemv_add", "decode_gemv_swiglu", "rope_store_kv")
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)


class _CopyingArrays(TorchArrays):
    """Places every weight in fresh memory, as a copy to the GPU does (on the CPU, torch may
    keep a float32 tensor as a view into the checkpoint's buffer, at any alignment)."""

    def place(self, weight, dtype: str):
        return super().place(weight, dtype).clone()


@pytest.fixture
def reference_ops(monkeypatch):
    for name in _OPS + _MOE_OPS + FUSED_OPS + ("embedding", "rms_norm_gated"):
        monkeypatch.setattr(ops, name, getattr(reference, name))


def _models(folder, gguf_blocks: dict | None = None):
    """(unfused, fused) Decoders over the same float32 torch CPU weights; with gguf_blocks
    (to_gguf's), the dense projections are those blocks instead of floats, adjacent parts of one
    type joined as the GGUF loader joins them."""
    from freetoken.models.checkpoint.weights import _fuse_rows

    config, tensors, _, _ = read_hf_dir(folder)
    arrays = _CopyingArrays(parse_device("cpu"))
    weights = build_decoder_weights(tensors, config, Placement(arrays, "float32"))
    for i, lw in enumerate(weights.layers if gguf_blocks else ()):
        for name, parts in GGUF_PARTS.items():
            quant = [gguf_blocks[f"model.layers.{i}.{p}.weight"] for p in parts]
            quant = [QuantWeight(qtype, torch.from_numpy(b), shape) for qtype, b, shape in quant]
            lw[name] = _fuse_rows(quant) if len(quant) > 1 else quant[0]
    # the load-time rule accepts this layout (one matrix per fused entry) on a GPU
    assert fused_decode.supported(config, weights.layers, "bfloat16", parse_device("cuda:0"))
    plain = Decoder(config, weights, arrays, "float32")
    fused = Decoder(config, weights, arrays, "float32")
    assert plain._fused is None and fused._fused is None  # CPU: the rule says no
    fused.use_fused_layers([fused_decode.FusedLayer(layer, lw, config, i, fused._rope, fused._k,
                                                    132, fused.device)
                            for i, (layer, lw) in enumerate(zip(fused.layers, weights.layers))])
    return config, plain, fused


# qwen2_moe: dense and routed layers in turn, a shared expert
EXTRA = {"qwen2_moe": dict(num_hidden_layers=4, decoder_sparse_step=2),
         "mistral": dict(sliding_window=8)}


def _steps_match_transformers(hf, arch, plain, fused, config, prompt_lengths, seed):
    """Prefill each prompt (unfused: longer than MAX_TOKENS), then decode steps of T = 3 and 4
    (norms as kernels), 2 and 1 (norms in the GEMV prologues) and a 4-token chunk; every row's
    logits of both models against transformers' float32 forward of the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lengths]
    runners = [PagedRunner(m, num_blocks=16, block_size=4, seed=2) for m in (plain, fused)]
    seqs = [list(p) for p in prompts]
    for runner in runners:
        for seq, prompt in enumerate(prompts):
            runner.step([(seq, prompt)])
    steps = [[(0, [5]), (1, [6]), (2, [7])], [(2, [8]), (0, [9])], [(1, [10])],
             [(0, [11, 12, 13, 14])], [(0, [1]), (1, [2]), (2, [3])]]
    for chunks in steps:
        theirs, ours = (r.step(chunks).clone() for r in runners)  # (plain, fused)
        for row, (seq, tokens) in enumerate(chunks):
            seqs[seq] += tokens
            with torch.no_grad():
                ref = hf(torch.tensor([seqs[seq]])).logits[0, -1]
            assert_logits_close(ours[row], ref, config, msg=f"fused {arch} {chunks} row {row}")
            assert_logits_close(theirs[row], ref, config, msg=f"plain {arch} {chunks}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "mistral", "qwen3_moe",
                                  "qwen2_moe"])
def test_fused_decode_steps_match_transformers(arch, tmp_path, reference_ops):
    hf = tiny_hf_model(arch, tmp_path, seed=11, **{**SHAPE, **EXTRA.get(arch, {})})
    config, plain, fused = _models(tmp_path)
    _steps_match_transformers(hf, arch, plain, fused, config, (9, 3, 20), seed=4)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_fused_decode_steps_of_hybrid_models_match_transformers(arch, tmp_path, reference_ops):
    """Gated DeltaNet layers (in projection, conv, recurrence, gated norm, out projection over
    the residual) and gated attention (a second normed-input GEMV for the gate) on the fused
    path; qwen3_next has a dense MLP layer too. The recurrent states carry across the fused
    and unfused steps alike."""
    from tests.models.test_hybrid_hf import build_hybrid

    hf = build_hybrid(arch, tmp_path, seed=3)
    config, plain, fused = _models(tmp_path)
    assert any(layer.linear for layer in fused._fused)
    assert any(getattr(layer, "o_gate", None) is not None for layer in fused._fused)
    _steps_match_transformers(hf, arch, plain, fused, config, (9, 3, 12), seed=8)


def test_tuned_choices_reach_the_kernels(tmp_path, reference_ops, monkeypatch):
    """A TUNED entry's variant and group reach the kernel calls, and moving the norm out of
    the prologue (rms_norm first) leaves the logits as close to transformers as before."""
    hf = tiny_hf_model("qwen3", tmp_path, seed=5, **SHAPE)
    h, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    qkv_rows = (SHAPE["num_attention_heads"] + 2 * SHAPE["num_key_value_heads"]) * 16
    choices = {("qkv", qkv_rows, h, 1): fused_decode.GemvChoice(3, 64, False),
               ("swiglu", inter, h, 1): fused_decode.GemvChoice(4, 0, False),
               ("add", h, h, 1): fused_decode.GemvChoice(5, 0),
               ("add", h, inter, 1): fused_decode.GemvChoice(2, 128)}
    for key, choice in choices.items():
        monkeypatch.setitem(fused_decode.TUNED, key, choice)
    calls = []

    def recording(name):
        def call(*args):
            calls.append((name, args[-2], args[-1]))  # (kernel, group, variant)
            getattr(reference, name)(*args)
        return call

    for name in FUSED_OPS[:3]:
        monkeypatch.setattr(ops, name, recording(name))
    config, _, fused = _models(tmp_path)
    runner = PagedRunner(fused, num_blocks=16, block_size=4, seed=2)
    prompt = list(range(3, 12))
    runner.step([(0, prompt)])
    calls.clear()
    logits = runner.step([(0, [7])])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + [7]])).logits[0, -1]
    assert_logits_close(logits, ref, config, msg="tuned fused step")
    group = fused_decode.gemv_group
    expected = [("decode_gemv", 64, 3), ("decode_gemv_add", group(h, h, 132), 5),
                ("decode_gemv_swiglu", min(128, group(inter, h, 132)), 4),
                ("decode_gemv_add", 128, 2)]
    assert calls == expected * SHAPE["num_hidden_layers"]


# our fused entry -> the HF projections whose rows it stacks
GGUF_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
              "down": ("mlp.down_proj",)}
Q4_0, Q8_0, Q4_K, Q6_K = 2, 8, 12, 14
# GGUF type per HF projection: every projection Q4_K; a Q4_K_M-like mix (v and down Q6_K, so
# qkv is two parts); Q8_0; Q4_0 (its offset of 8 taken in float)
MIXES = {"q4_k": {}, "q4_k_m": {"v_proj": Q6_K, "down_proj": Q6_K},
         "q8_0": dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"), Q8_0),
         "q4_0": dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"), Q4_0)}


def to_gguf(hf, folder, seed: int, mix: dict) -> dict:
    """Every projection of `hf` set to the values of random GGUF blocks of its mix type (Q4_K
    unless the mix names another), saved again to `folder` so transformers and the float load
    see the dequantized weights; (type, blocks, shape) by parameter name. Norm weights are drawn
    far from 1, so that a norm weight used in the wrong place moves the logits by much more than
    the activation rounding."""
    from tests.kernel.gguf_random import dequantize, random_blocks

    rng, blocks = np.random.default_rng(seed), {}
    for name, param in hf.named_parameters():
        if name.endswith("layernorm.weight"):
            with torch.no_grad():
                param.copy_(torch.from_numpy(rng.uniform(0.25, 2.0, param.shape)))
        proj = name.split(".")[-2]
        if any(f".{p}.weight" in name for parts in GGUF_PARTS.values() for p in parts):
            qtype = mix.get(proj, Q4_K)
            raw = random_blocks(qtype, *param.shape, rng, size=0.5)
            blocks[name] = (qtype, raw, tuple(param.shape))
            with torch.no_grad():
                param.copy_(torch.from_numpy(dequantize(raw, qtype)))
    hf.save_pretrained(folder)
    return blocks


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_fused_gguf_steps_match_the_unfused_chain(mix, tmp_path, reference_ops, monkeypatch):
    """GGUF projections on the fused path (gguf_gemv_q8, v3) at steps of up to 8 tokens where
    every part is Q4_K, Q6_K or Q8_0 (x within the staging) and 2 where one is another type
    (wider steps take the unfused chain); a qkv of two block types runs one product per part
    into its columns.
    The unfused model's GGUF products quantize their activations exactly as gguf_gemv_q8 does
    (kernel/reference.py) at those steps, so the two differ by float32 order alone, as the float
    fused step does from transformers; a wrong buffer, part offset, norm weight or residual add
    is off by O(1). (The int8 sums themselves: tests/kernel/test_gguf_gemv_q8_emulated.py.)"""
    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v3")
    calls = []
    most = 2 if mix == "q4_0" else 8     # the kernel's tokens for Q4_0 / Q4_K, Q6_K, Q8_0

    def int8_matmul(out, x, qweight, qtype):
        if x.shape[0] <= most:
            reference.gguf_gemv_q8(out, x, qweight, qtype)
        else:
            reference.quant_matmul(out, x, qweight, qtype)

    def recorded(*args):
        calls.append(args[7])                                   # the mode
        reference.gguf_gemv_q8(*args)

    monkeypatch.setattr(ops, "gguf_matmul", int8_matmul)
    monkeypatch.setattr(ops, "gguf_gemv_q8", recorded)
    # hidden and intermediate 2048: Q6_K rows of whole 16-byte words (K a multiple of 2048)
    hf = tiny_hf_model("qwen3", tmp_path, seed=11, hidden_size=2048, intermediate_size=2048,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    blocks = to_gguf(hf, tmp_path, seed=5, mix=MIXES[mix])
    config, plain, fused = _models(tmp_path, blocks)
    assert all(layer.max_tokens == most for layer in fused._fused)
    assert all(isinstance(layer.qkv, fused_decode.QuantProjection) for layer in fused._fused)
    qkv_parts = len(fused._fused[0].qkv.parts)
    assert qkv_parts == (2 if mix == "q4_k_m" else 1)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()
               for n in (9, 5)]
    runners = [PagedRunner(m, num_blocks=16, block_size=4, seed=2) for m in (plain, fused)]
    for runner in runners:
        for seq, prompt in enumerate(prompts):
            runner.step([(seq, prompt)])
    for chunks in ([(0, [5]), (1, [6])], [(1, [7])], [(0, [8, 9, 10])], [(0, [11])],
                   [(0, list(range(12, 17))), (1, [17, 18, 19])], [(1, list(range(20, 29)))]):
        calls.clear()
        theirs, ours = (r.step(chunks).clone() for r in runners)
        fused_step = sum(len(tokens) for _, tokens in chunks) <= most
        # store (qkv, per part), add (o), SwiGLU (gate_up), add (down) per layer, fused steps only
        layer_calls = [0] * qkv_parts + [1, 2, 1]
        assert calls == (layer_calls * config.num_layers if fused_step else []), calls
        for row in range(len(chunks)):
            assert_logits_close(ours[row], theirs[row], config, msg=f"{mix} {chunks} row {row}")


def to_fp8(hf, folder, config, weights, block: tuple[int, int]) -> None:
    """Every fused entry of `weights` replaced by an FP8 ScaledWeight of its float matrix (qkv
    and gate_up quantized whole, so one scale grid covers the joined rows), and `hf`'s
    projections set to the dequantized values (saved again to `folder`)."""
    from freetoken.models.quant import scaled
    from tests.models.scaled_checkpoint import quantize_fp8

    params = dict(hf.named_parameters())
    for i, lw in enumerate(weights.layers):
        for name, parts in GGUF_PARTS.items():
            full = torch.cat([params[f"model.layers.{i}.{p}.weight"].detach() for p in parts])
            q, grid = quantize_fp8(full, *block)
            weight = scaled.ScaledWeight(scaled.FP8, q, grid, tuple(full.shape), block)
            lw[name] = weight
            values = scaled.dequantize(weight)
            rows = 0
            for p in parts:
                param = params[f"model.layers.{i}.{p}.weight"]
                with torch.no_grad():
                    param.copy_(values[rows:rows + param.shape[0]])
                rows += param.shape[0]
    hf.save_pretrained(folder)


def test_fused_fp8_steps_match_transformers(tmp_path, reference_ops, monkeypatch):
    """FP8 projections on the fused path (fp8_gemv_fused, v3): float activations, so the fused
    and unfused steps over the same FP8 weights both match transformers' float32 forward of the
    dequantized weights as the float fused step does, at steps of 1-4 tokens."""
    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v3")
    monkeypatch.setattr(ops, "scaled_gemv", reference.scaled_gemv)
    monkeypatch.setattr(ops, "scaled_dequantize", reference.scaled_dequantize)
    calls = []

    def recorded(*args):
        calls.append(args[10])                                  # the mode
        reference.fp8_gemv_fused(*args)

    monkeypatch.setattr(ops, "fp8_gemv_fused", recorded)
    hf = tiny_hf_model("qwen3", tmp_path, seed=13, **SHAPE)
    config, tensors, _, _ = read_hf_dir(tmp_path)
    arrays = _CopyingArrays(parse_device("cpu"))
    weights = build_decoder_weights(tensors, config, Placement(arrays, "float32"))
    to_fp8(hf, tmp_path, config, weights, (32, 32))
    assert fused_decode.supported(config, weights.layers, "bfloat16", parse_device("cuda:0"))
    plain = Decoder(config, weights, arrays, "float32")
    fused = Decoder(config, weights, arrays, "float32")
    fused.use_fused_layers([fused_decode.FusedLayer(layer, lw, config, i, fused._rope, fused._k,
                                                    132, fused.device)
                            for i, (layer, lw) in enumerate(zip(fused.layers, weights.layers))])
    assert all(isinstance(layer.qkv, fused_decode.Fp8Projection) for layer in fused._fused)
    assert fused._fused_tokens == fused_decode.MAX_TOKENS
    _steps_match_transformers(hf, "qwen3-fp8", plain, fused, config, (9, 3, 20), seed=4)
    assert calls and set(calls) == {0, 1, 2}
