"""MoE GGUF files written as llama.cpp's converter lays them out (stacked ffn_*_exps, router
ffn_gate_inp, shared-expert tensors, {arch}.expert_* metadata; Mixtral as `llama` with experts)
from the same random weights as the safetensors folder of test_moe_hf.py.

F32 files must give the safetensors folder's logits (same float32 values, 1e-4); F16 files
those of transformers holding the same float16-rounded weights (1e-4). Q8_0 experts stay
quantized on the CPU; their logits must agree with transformers on the dequantized weights to
5% of the largest logit (an experts kernel may round activations to 8 bits, as the quantized
matmuls do: the dense GGUF tests measured up to 2.2%). Only the experts are quantized there:
Q8_0 attention is covered by the dense GGUF tests, and 8-bit activations in every projection
can move a token to another expert, a jump no quantization tolerance bounds.
"""

from __future__ import annotations

import pytest
import torch

from freetoken.kernel.ops import Q8_0
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.models.test_dense_hf import hf_last_logits, prompts
from tests.models.test_gguf_tiny import REL_TOL, dequantized_reference
from tests.conftest import registry_has_moe_kernel
from tests.models.conftest import MOE_ARCHS
from tests.models.tiny_gguf import write_gguf

F16 = 1


@pytest.fixture(scope="module")
def moe_gguf(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in made:
            directory, hf = tiny_checkpoint(arch)
            path = tmp_path_factory.mktemp(f"gguf-{arch}-{kind}") / f"tiny-{arch}.gguf"
            qtype = Q8_0 if kind == "q8_0" else None
            state = write_gguf(hf, directory, path, arch, qtype,
                               float_type=F16 if kind == "f16" else None,
                               quantize_only=("_exps.weight",))
            made[arch, kind] = (path, directory, hf, dequantized_reference(hf, state))
        return made[arch, kind]

    return get


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_f32_gguf_gives_the_safetensors_logits(arch, moe_gguf, moe_ops):
    path, directory, _, _ = moe_gguf(arch, "f32")
    ours, folder = load_model(str(path)), load_model(str(directory))
    assert ours.config.architecture == arch
    assert ours.config.moe == folder.config.moe
    a, b = prompts(folder.config.vocab_size)
    chunks = [(0, a), (1, b)]
    assert_logits_close(PagedRunner(ours.model).step(chunks),
                        PagedRunner(folder.model).step(chunks), folder.config)


def test_f16_gguf_matches_transformers_on_the_rounded_weights(moe_gguf, moe_ops):
    path, _, _, reference = moe_gguf("qwen2_moe", "f16")
    loaded = load_model(str(path))
    a, _ = prompts(loaded.config.vocab_size)
    assert_logits_close(PagedRunner(loaded.model).step([(0, a)])[0],
                        hf_last_logits(reference, a), loaded.config)


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_q8_0_gguf_keeps_experts_quantized(arch, pack, moe_gguf, moe_ops, monkeypatch):
    """In the file's layout and (FREETOKEN_CPU_PACK, on AVX-512 VNNI CPUs running the
    registry's kernels) repacked 16 rows wide at load."""
    from freetoken.kernel import ops
    from freetoken.models.forward.linear import packs_on_cpu

    monkeypatch.setenv("FREETOKEN_CPU_PACK", "1" if pack else "0")
    path, _, _, reference = moe_gguf(arch, "q8_0")
    loaded = load_model(str(path))
    sparse = [layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "qtypes")]
    assert sparse and all(mlp.qtypes == (Q8_0, Q8_0) for mlp in sparse)
    packs = pack and packs_on_cpu(Q8_0, 16, "moe_experts_quant")
    assert packs == (pack and ops.cpu_isa() == "avx512" and registry_has_moe_kernel())
    assert all(mlp.packed == (packs, packs) for mlp in sparse)
    runner = PagedRunner(loaded.model)
    a, b = prompts(loaded.config.vocab_size)
    logits = runner.step([(0, a), (1, b)])
    for row, seq in ((0, a), (1, b)):
        expected = hf_last_logits(reference, seq)
        assert (logits[row] - expected).abs().max() < REL_TOL * expected.abs().max()


def test_expert_tensor_of_an_unsupported_type_is_refused(tiny_checkpoint, tmp_path):
    """An IQ4_NL expert tensor (a type this build has no kernel for) is named at load."""
    import numpy as np

    from freetoken.models.errors import UnsupportedModelError

    directory, hf = tiny_checkpoint("olmoe")
    iq4_nl, block_bytes = 20, 18
    cfg = hf.config
    blocks = np.zeros((cfg.num_experts, cfg.intermediate_size, cfg.hidden_size // 32 * block_bytes),
                      np.uint8)
    path = tmp_path / "iq4.gguf"
    write_gguf(hf, directory, path, "olmoe", None,
               raw={"blk.0.ffn_up_exps.weight": (blocks, iq4_nl)})
    with pytest.raises(UnsupportedModelError,
                       match="'blk.0.ffn_up_exps.weight' has type IQ4_NL.*supported: F32"):
        load_model(str(path))
