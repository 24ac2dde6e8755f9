"""Tokenizer behaviour on a tiny byte-level BPE: streaming decode, chat templates (rendered in
the sandbox, compared with transformers' rendering), eos ids."""

from __future__ import annotations

import json

import pytest

from freetoken.models.errors import ChatTemplateError
from freetoken.models.tokenizer.hf import hf_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}{{ 'Tools: ' + tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system must come first') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    directory, _ = tiny_checkpoint("llama")
    return hf_tokenizer(directory, {}, {})


def with_template(tok, template: str):
    from freetoken.models.tokenizer.core import Tokenizer

    return Tokenizer(tok.backend, chat_template=template, bos_token_id=None,
                     eos_token_ids=(), special_tokens=tok.special_tokens)


def test_incremental_decoder_never_splits_characters(tok):
    text = "héllo wörld 東京 🚀 done 👍🏽!"
    ids = tok.encode(text)
    stream = tok.incremental_decoder()
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 5          # really incremental


def test_incremental_decoder_skips_special_tokens(tok):
    end = tok.token_id("<|im_end|>")
    ids = tok.encode("Paris.") + [end]
    stream = tok.incremental_decoder(skip_special_tokens=True)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "Paris."
    assert end in tok.eos_token_ids


def test_special_token_text_becomes_one_id(tok):
    ids = tok.encode("<|im_start|>user")
    assert ids[0] == tok.token_id("<|im_start|>")
    assert tok.decode(ids) == "user"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user"


def test_chat_template_matches_transformers(tiny_checkpoint, tok):
    from transformers import PreTrainedTokenizerFast

    directory, _ = tiny_checkpoint("llama")
    reference = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tools = [{"type": "function", "function": {"name": "weather", "description": "Météo"}}]
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    ours = with_template(tok, TOOL_TEMPLATE)
    for kwargs in ({}, {"tools": tools}):
        expected = reference.apply_chat_template(messages, chat_template=TOOL_TEMPLATE,
                                                 add_generation_prompt=True, tokenize=False,
                                                 **kwargs)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) \
            == expected
    assert '"Météo"' in ours.apply_chat_template(messages, tools=tools)   # tojson keeps unicode


def test_raise_exception_becomes_chat_template_error(tok):
    ours = with_template(tok, TOOL_TEMPLATE)
    bad = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="system must come first"):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__ }}",
    "{% set x = messages.append(1) %}",
])
def test_sandbox_blocks_unsafe_templates(tok, template):
    with pytest.raises(ChatTemplateError, match="failed to render"):
        with_template(tok, template).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_helpers_and_generation_tag(tok):
    template = ("{{ strftime_now('%Y') }}#{% for m in messages %}{% generation %}"
                "{{ m['content'] }}{% endgeneration %}{% endfor %}#{{ eos_token }}")
    text = with_template(tok, template).apply_chat_template([{"role": "user", "content": "x"}])
    year, body, eos = text.split("#")
    assert year.isdigit() and len(year) == 4 and body == "x" and eos == "<|im_end|>"


def test_template_errors(tok):
    with pytest.raises(ChatTemplateError, match="does not compile"):
        with_template(tok, "{% for %}").apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        with_template(tok, None).apply_chat_template([])


def test_eos_ids_from_generation_config(tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint("llama")
    (tmp_path / "tokenizer.json").write_bytes((directory / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    tok = hf_tokenizer(tmp_path, {"eos_token_id": 0}, {"eos_token_id": [1, 0]})
    assert tok.eos_token_ids[:2] == (1, 0)
    assert tok.token_id("<|im_end|>") in tok.eos_token_ids    # end-of-turn spelling


def gguf_meta_from(directory, pre: str, add_bos: bool) -> dict:
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {t["content"] for t in spec["added_tokens"] if t["special"]}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m)
                                      for m in spec["model"]["merges"]],
            "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": vocab["<|im_start|>"],
            "tokenizer.ggml.eos_token_id": vocab["<|im_end|>"],
            "tokenizer.ggml.add_bos_token": add_bos}


@pytest.mark.parametrize("pre, pieces", [
    ("default", ["12345", "Ġabc"]),
    ("smollm", ["1", "2", "3", "4", "5", "Ġabc"]),
    ("llama-bpe", ["123", "45", "Ġabc"]),
    ("qwen2", ["1", "2", "3", "4", "5", "Ġabc"]),
])
def test_gguf_pre_tokenizer_families(tiny_checkpoint, pre, pieces):
    from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

    directory, _ = tiny_checkpoint("llama")
    tok = tokenizer_from_gguf(gguf_meta_from(directory, pre, False), "m.gguf")
    split = tok.backend.pre_tokenizer.pre_tokenize_str("12345 abc")
    assert [piece for piece, _ in split] == pieces


def test_gguf_add_bos_and_unknown_pre(tiny_checkpoint):
    from freetoken.models.errors import UnsupportedModelError
    from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

    directory, _ = tiny_checkpoint("llama")
    tok = tokenizer_from_gguf(gguf_meta_from(directory, "llama-bpe", True), "m.gguf")
    bos = tok.token_id("<|im_start|>")
    assert tok.encode("hi", add_special_tokens=True)[0] == bos
    assert tok.encode("hi")[0] != bos
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.pre 'klingon'"):
        tokenizer_from_gguf(gguf_meta_from(directory, "klingon", False), "m.gguf")


def test_gguf_qwen35_pre_tokenizer_matches_transformers(tiny_checkpoint):
    """Qwen3.5/3.6 files (tokenizer.ggml.pre qwen35) keep combining marks inside words, as
    transformers' Qwen3_5Tokenizer does; Qwen2's split would cut the Devanagari below apart."""
    from transformers import Qwen3_5Tokenizer

    from freetoken.models.tokenizer.gguf import tokenizer_from_gguf

    directory, _ = tiny_checkpoint("llama")
    meta = gguf_meta_from(directory, "qwen35", False)
    ours = tokenizer_from_gguf(meta, "m.gguf")
    vocab = {token: i for i, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    theirs = Qwen3_5Tokenizer(vocab=vocab, merges=merges)
    texts = ["नमस्ते दुनिया", "a\u0302\u0301b c\u0327a", "12345 abc, héllo wörld!\n\n  x"]

    def pieces(backend, text: str) -> list[str]:
        normed = backend.normalizer.normalize_str(text)
        return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normed)]

    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert pieces(ours.backend, text) == pieces(theirs.backend_tokenizer, text), text
    qwen2 = tokenizer_from_gguf(gguf_meta_from(directory, "qwen2", False), "m.gguf")
    assert len(pieces(ours.backend, texts[0])) < len(pieces(qwen2.backend, texts[0]))
