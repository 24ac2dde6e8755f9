"""GGUF models on the GPU with their blocks kept in VRAM (gguf_gemm), against independent
paths over the same file: the CPU's quantized kernels (Q8_0), the GPU's float path over
gguf's numpy dequantization (K-quants, which the CPU does not read), and the embedded SmolLM2
on the CPU. bf16 activations against float32 ones differ by bf16 rounding carried through the
layers: logits are compared to 5% of their largest value, the greedy token where the top two
are further apart than twice that (a wrong block decode is off by O(100%))."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.models.checkpoint.weights import gpu_rows
from freetoken.models.config import QuantWeight
from freetoken.models.forward.linear import PartsLinear, QuantLinear
from freetoken.models.loader import load_model
from tests.kernel.gguf_random import random_blocks
from tests.models.helpers import PagedRunner, tiny_hf_model
from tests.models.tiny_gguf import write_gguf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REL_TOL = 0.05
Q8_0, Q4_K, Q5_K, Q6_K = 8, 12, 13, 14
# A Q4_K_M-like mix: Q6_K for v, the head and the embedding, Q5_K for down, Q4_K elsewhere.
K_MIX = {"attn_q": Q4_K, "attn_k": Q4_K, "attn_v": Q6_K, "attn_output": Q4_K,
         "ffn_gate": Q4_K, "ffn_up": Q4_K, "ffn_down": Q5_K}
# Every projection Q4_K: one matrix per fused entry, so FREETOKEN_QUANT_GEMV=v3 fuses the step;
# and the Q4_K_M pattern (Q6_K v and down) that gguf_gemv_q8 reads at widths of 2048
K_ALL = dict.fromkeys(K_MIX, Q4_K)
K_M_WIDE = dict(K_ALL, attn_v=Q6_K, ffn_down=Q6_K)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def _k_quant_file(tmp_path, mix: dict = K_MIX, shape: dict = SHAPE) -> tuple:
    hf = tiny_hf_model("llama", tmp_path, seed=3, **shape)
    rng = np.random.default_rng(0)
    h = shape["hidden_size"]
    raw = {"token_embd.weight": (random_blocks(Q6_K, hf.config.vocab_size, h, rng), Q6_K),
           "output.weight": (random_blocks(Q6_K, hf.config.vocab_size, h, rng), Q6_K)}
    # zero-mean blocks, as a quantizer writes them (random_blocks' doc): through int8
    # activations a model of raw random K-quant bytes moves its logits by 10-30% (measured
    # with the rounding restated in numpy on the float weights), a quantized file's by ~1%
    for name, param in hf.state_dict().items():
        if ".layers." not in name or param.ndim != 2:
            continue
        from tests.models.tiny_gguf import gguf_name

        gname = gguf_name(name)
        qtype = mix[gname.split(".")[2]]
        raw[gname] = (random_blocks(qtype, param.shape[0], param.shape[1], rng, centered=True),
                      qtype)
    path = tmp_path / "k-mix.gguf"
    write_gguf(hf, tmp_path, path, "llama", None, raw=raw)
    return path, raw


def _assert_close_logits(ours: torch.Tensor, expected: torch.Tensor) -> None:
    ours, expected = ours.float().cpu(), expected.float().cpu()
    scale = expected.abs().max()
    assert (ours - expected).abs().max() < REL_TOL * scale
    top2 = expected.topk(2).values
    if top2[0] - top2[1] > 2 * REL_TOL * scale:
        assert int(ours.argmax()) == int(expected.argmax())


def _compare(model, reference, vocab: int, steps: int = 4) -> None:
    prompt = torch.randint(0, vocab, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, ref = PagedRunner(model), PagedRunner(reference)
    a, b = ours.step([(0, prompt), (1, prompt[:5])]), ref.step([(0, prompt), (1, prompt[:5])])
    for row in range(2):
        _assert_close_logits(a[row], b[row])
    for _ in range(steps):           # decode (the GEMV path), fed the reference's tokens
        token = int(b[0].argmax())
        a, b = ours.step([(0, [token])]), ref.step([(0, [token])])
        _assert_close_logits(a[0], b[0])


def test_k_quant_mix_stays_in_vram_and_matches_the_dequantized_float_path(tmp_path):
    path, raw = _k_quant_file(tmp_path)
    gpu = load_model(str(path), device="cuda")              # bf16: blocks stay quantized
    reference = load_model(str(path), device="cuda", dtype="float32")   # dequantized at load
    layer = gpu.model.layers[0]
    qkv = layer.attn.qkv
    assert isinstance(qkv, PartsLinear)                      # Q4_K q + k rows, Q6_K v rows
    for part, names in zip(qkv.parts, (("attn_q", "attn_k"), ("attn_v",))):
        assert part.data.dtype == torch.uint8 and part.data.is_cuda
        # the file's blocks, rows padded to whole 16-byte words (Q6_K rows of 210 bytes: 224)
        assert part.data.nbytes == sum(gpu_rows(raw[f"blk.0.{n}.weight"][0]).nbytes
                                       for n in names)
    down = layer.mlp.down
    assert isinstance(down, QuantLinear) and down.qtype == Q5_K
    assert down.data.nbytes == raw["blk.0.ffn_down.weight"][0].nbytes
    assert isinstance(gpu.model._embed, QuantWeight) and gpu.model._embed.data.is_cuda
    assert not isinstance(reference.model._embed, QuantWeight)
    _compare(gpu.model, reference.model, gpu.config.vocab_size)


@pytest.mark.parametrize("mix", ["all-q4_k", "q4_k_m"])
def test_fused_decode_v3_matches_the_dequantized_float_path(tmp_path, monkeypatch, mix):
    """FREETOKEN_QUANT_GEMV=v3: every GGUF projection of a 1-8 token step (Q4_K and Q6_K rows
    of K = 2048 take 8) runs gguf_gemv_q8 on the fused chain (int8 activations: a rounding far
    inside REL_TOL); in the Q4_K_M-like mix
    qkv is two parts (Q4_K q and k, Q6_K v) and down is Q6_K, read by the staged kernel."""
    from freetoken.models.forward import fused_decode

    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v3")
    wide = dict(SHAPE, hidden_size=2048, intermediate_size=2048)   # Q6_K rows of whole words
    path, _ = _k_quant_file(tmp_path, K_ALL if mix == "all-q4_k" else K_M_WIDE, wide)
    gpu = load_model(str(path), device="cuda")
    reference = load_model(str(path), device="cuda", dtype="float32")
    assert gpu.model._fused is not None and reference.model._fused is None
    assert all(isinstance(layer.qkv, fused_decode.QuantProjection) and layer.max_tokens == 8
               for layer in gpu.model._fused)
    assert len(gpu.model._fused[0].qkv.parts) == (1 if mix == "all-q4_k" else 2)
    assert gpu.model._lm_head._q8 is not None       # Q6_K head, K = 2048: gguf_gemv_q8 too
    _compare(gpu.model, reference.model, gpu.config.vocab_size, steps=6)


def test_q8_0_model_on_the_gpu_matches_the_cpu(tmp_path):
    hf = tiny_hf_model("qwen3", tmp_path, seed=5, **SHAPE)
    path = tmp_path / "q8.gguf"
    write_gguf(hf, tmp_path, path, "qwen3", Q8_0, embed_qtype=Q8_0)
    gpu, cpu = load_model(str(path), device="cuda"), load_model(str(path))
    assert isinstance(gpu.model.layers[1].mlp.gate_up, QuantLinear)
    _compare(gpu.model, cpu.model, gpu.config.vocab_size)


@pytest.mark.parametrize("variant, mix", [("v2", K_MIX), ("v3", K_ALL)])
def test_k_quant_decode_in_cuda_graphs_gives_the_eager_tokens(tmp_path, monkeypatch, variant,
                                                              mix):
    import asyncio

    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from freetoken.engine.request import SamplingParams

    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", variant)
    path, _ = _k_quant_file(tmp_path, mix)
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


@pytest.mark.needs_weights
def test_smollm2_on_the_gpu_keeps_q8_0_embedding_and_matches_the_cpu():
    """The embedded SmolLM2 (Q4_1 layers, tied Q8_0 embedding and head) stays quantized in VRAM;
    its first-step distribution matches the CPU's (8-bit activations there, bf16 here)."""
    gpu, cpu = load_model(None, device="cuda"), load_model(None)
    embed = gpu.model._embed
    assert isinstance(embed, QuantWeight) and embed.qtype == Q8_0 and embed.data.is_cuda
    # the file's Q8_0 bytes, each 612-byte row padded to whole 16-byte words
    assert embed.data.nbytes == 49152 * (-(-(576 // 32 * 34) // 16) * 16)
    assert isinstance(gpu.model._lm_head, QuantLinear) and gpu.model._lm_head.data is embed.data
    ids = gpu.tokenizer.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                               "<|im_start|>assistant\n")
    p = PagedRunner(cpu.model, num_blocks=16).step([(0, ids)])[0].float().log_softmax(-1)
    q = PagedRunner(gpu.model, num_blocks=16).step([(0, ids)])[0].float().cpu().log_softmax(-1)
    kl = float((p.exp() * (p - q)).sum())
    # each side is within ~0.02 nats of transformers' float32 (tests/models/test_smollm2.py):
    # 8-bit activations on the CPU, bf16 ones here; a wrong block decode is off by nats
    assert kl < 0.1, f"KL(cpu || gpu) = {kl:.4f} nats"
