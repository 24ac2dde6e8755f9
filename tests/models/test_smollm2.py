"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers.

transformers' GGUF path dequantizes the same file to float32. `from_pretrained(gguf_file=...)`
insists on the `accelerate` package, which this project does not depend on, so the reference
is assembled from the same pieces it uses: the GGUF config, the model class, and
`load_gguf_checkpoint`'s dequantized (and un-permuted) tensors. Its GGUF parsing runs over a
plain array view of the file instead of np.memmap (same parser, several times faster).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import PagedRunner

pytestmark = pytest.mark.needs_weights

KL_LIMIT = 0.02   # nats; our matmuls quantize activations to 8 bits, transformers runs f32
QUESTION = "What is the capital of France? Answer in one sentence."
TEXTS = ["Hello, world!", "  leading and  double  spaces ", "tabs\tand\nnewlines\n\n",
         "digits 0 12 345 6789 3.14159 1,000,000",
         "naïve café déjà vu — “quotes”",
         "日本語のテキスト 中文 한국어 🚀🎉", "def f(x):\n    return x ** 2  # square\n",
         "<|im_start|>user\nhi<|im_end|>", "emoji👍🏽 and ZWJ 👨‍👩‍👧"]
CONVERSATIONS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Bye"}],
]


@pytest.fixture(scope="module")
def ours():
    from freetoken.models.loader import load_model

    return load_model(None)


@pytest.fixture(scope="module")
def reference(ours):
    from pathlib import Path

    from tests.models.helpers import transformers_from_gguf

    return transformers_from_gguf(Path(ours.source), with_tokenizer=True)


def chat_prompt(tokenizer, messages=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages or CONVERSATIONS[0], add_generation_prompt=True)
    return tokenizer.encode(text)


def test_first_step_logits_close_to_transformers(ours, reference):
    model, _ = reference
    ids = chat_prompt(ours.tokenizer)
    logits = PagedRunner(ours.model, num_blocks=16).step([(0, ids)])[0]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0, -1].float()
    log_p, log_q = expected.log_softmax(-1), logits.log_softmax(-1)
    kl = float((log_p.exp() * (log_p - log_q)).sum())
    assert kl < KL_LIMIT, f"KL(p_hf || p_ours) = {kl:.4f} nats"


def test_tokenizer_matches_transformers(ours, reference):
    _, tokenizer = reference
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=False), text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ours.tokenizer.bos_token_id == 1
    assert 2 in ours.tokenizer.eos_token_ids          # <|im_end|>


def test_chat_template_matches_transformers(ours, reference):
    _, tokenizer = reference
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=add,
                                                     tokenize=False)
            assert ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add) \
                == expected


def test_greedy_answer_names_paris(ours):
    tok = ours.tokenizer
    runner = PagedRunner(ours.model, num_blocks=16)
    logits = runner.step([(0, chat_prompt(tok))])
    reply = []
    for _ in range(40):
        token = int(logits[0].argmax())
        if token in tok.eos_token_ids:
            break
        reply.append(token)
        logits = runner.step([(0, [token])])
    text = tok.decode(reply)
    assert "Paris" in text, text


def test_greedy_tokens_match_llama_cpp_with_a_float16_kv_pool(ours):
    """With the CPU's default float16 KV pool, greedy decoding of the README question gives
    llama.cpp's tokens (llama.cpp keeps its KV cache in float16 too)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    tok = ours.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]),
        add_special_tokens=False)
    runner = PagedRunner(ours.model, num_blocks=16, kv_dtype="float16")
    logits, ours_tokens = runner.step([(0, prompt)]), []
    for _ in range(30):
        ours_tokens.append(int(logits[0].argmax()))
        logits = runner.step([(0, ours_tokens[-1:])])
    llm = llama_cpp.Llama(model_path=ours.source, n_ctx=512, verbose=False,
                          use_extra_bufts=False)
    theirs = []
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        theirs.append(token)
        if len(theirs) == 30:
            break
    assert ours_tokens == theirs, (tok.decode(ours_tokens), tok.decode(theirs))
