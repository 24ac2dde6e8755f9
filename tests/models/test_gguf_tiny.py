"""GGUF loading on tiny files written like llama.cpp's converter: q/k row order (llama),
block-quantized weights kept quantized, tied/untied heads, and the GGUF vocabulary.

The reference is HF transformers holding exactly the dequantized weights of the file. The
quantized matmul kernels quantize activations to 8 bits, so logits agree to ~1e-2 of their
scale rather than float precision (measured up to 2.2%): the tolerance is 5% of the
largest logit.
"""

from __future__ import annotations

import pytest

from freetoken.kernel.ops import Q4_0, Q4_1, Q8_0
from freetoken.models.config import QuantWeight
from freetoken.models.errors import ModelOptionError
from freetoken.models.forward.linear import QuantLinear
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner
from tests.models.test_dense_hf import hf_last_logits, prompts
from tests.models.tiny_gguf import write_gguf

REL_TOL = 0.05
CASES = {"llama": (Q8_0, Q8_0), "qwen2": (Q4_0, None), "qwen3": (Q4_1, Q8_0)}
TEXTS = ["hello world", "  two  spaces\tand tab\n", "numbers 12345 and 678",
         "héllo wörld 東京 🚀", "def add(a, b):\n    return a + b",
         "<|im_start|>user\nhi<|im_end|>"]


def dequantized_reference(hf, state: dict):
    model = type(hf)(hf.config).eval()
    model.load_state_dict(state)
    return model


@pytest.fixture(scope="module")
def gguf_case(tiny_checkpoint, tmp_path_factory):
    made = {}

    def get(arch: str):
        if arch not in made:
            directory, hf = tiny_checkpoint(arch)
            path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
            state = write_gguf(hf, directory, path, arch, *CASES[arch])
            made[arch] = (path, directory, dequantized_reference(hf, state))
        return made[arch]

    return get


@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_forward_matches_dequantized_transformers(arch, gguf_case):
    path, _, reference = gguf_case(arch)
    loaded = load_model(str(path))
    assert loaded.config.architecture == arch
    assert isinstance(loaded.model.layers[0].attn.qkv, QuantLinear)   # stayed quantized on CPU
    runner = PagedRunner(loaded.model)
    a, b = prompts(loaded.config.vocab_size)
    logits = runner.step([(0, a), (1, b)])
    for row, seq in ((0, a), (1, b)):
        expected = hf_last_logits(reference, seq)
        scale = expected.abs().max()
        assert (logits[row] - expected).abs().max() < REL_TOL * scale
    for _ in range(4):   # decode: the greedy token agrees wherever the margin is clear
        a.append(int(logits[0].argmax()))
        logits = runner.step([(0, a[-1:])])
        expected = hf_last_logits(reference, a)
        top2 = expected.topk(2).values
        assert (logits[0] - expected).abs().max() < REL_TOL * expected.abs().max()
        if top2[0] - top2[1] > 2 * REL_TOL * expected.abs().max():
            assert int(logits[0].argmax()) == int(expected.argmax())


def test_cpu_keeps_gguf_blocks_and_computes_in_float32(gguf_case):
    path, _, _ = gguf_case("llama")
    f32 = load_model(str(path), dtype="float32")
    assert isinstance(f32.model._embed, QuantWeight) and f32.model.dtype == "float32"
    with pytest.raises(ModelOptionError, match="float32"):
        load_model(str(path), dtype="bfloat16")


def test_gguf_tokenizer_matches_tokenizer_json(gguf_case):
    from tokenizers import Tokenizer as Backend

    path, directory, _ = gguf_case("llama")
    ours = load_model(str(path)).tokenizer
    reference = Backend.from_file(str(directory / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    end = reference.token_to_id("<|im_end|>")
    assert end in ours.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "<|im_start|>user\nhi<|im_end|>\n" \
                                                 "<|im_start|>assistant\n"


def test_cpu_serving_of_a_gguf_never_imports_torch(gguf_case):
    """Loading, the engine (greedy and sampled) and the HTTP app run on numpy + the kernels;
    torch costs seconds of start-up, so the CPU path must not pull it in."""
    import subprocess
    import sys

    path, _, _ = gguf_case("llama")
    script = f"""
import asyncio, sys
from freetoken.engine.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.request import SamplingParams
from freetoken.models.loader import load_model
import freetoken.server.app, freetoken.cli.main
engine = Engine.from_loaded(load_model({str(path)!r}, device="auto"), EngineConfig()).start()
async def run(params):
    return [out async for out in engine.generate([1, 2, 3], params)]
for params in (SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
               SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=5,
                              ignore_eos=True)):
    outs = asyncio.run(run(params))
    print(sum(len(o.token_ids) for o in outs), outs[-1].finish_reason)
engine.shutdown()
print("torch loaded:", "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["5 length", "5 length", "torch loaded: False"]
