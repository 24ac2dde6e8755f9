"""A `tokenizers` byte-level BPE rebuilt from GGUF vocabulary metadata (tokenizer.ggml.*)."""

from __future__ import annotations

from typing import Any

from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.tokenizer import Tokenizer

# GGML token types (llama.cpp): 3 = control (special), 4 = user-defined (matched whole).
_CONTROL, _USER_DEFINED = 3, 4

# Split patterns of the pre-tokenizer families, as their vocabularies were trained.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (family, BPE ignore_merges)
_PRE_FAMILIES = {
    "default": ("gpt2", False), "gpt-2": ("gpt2", False), "gpt2": ("gpt2", False),
    "smollm": ("digits", False), "starcoder": ("digits", False), "refact": ("digits", False),
    "codeshell": ("digits", False),
    "llama-bpe": ("llama3", True), "llama3": ("llama3", True), "llama-v3": ("llama3", True),
    "smaug-bpe": ("llama3", True), "dbrx": ("llama3", True), "falcon3": ("llama3", True),
    "qwen2": ("qwen2", False), "deepseek-r1-qwen": ("qwen2", False),
}


def _pre_tokenizer(family: str):
    from tokenizers import Regex, pre_tokenizers

    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":   # every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _field(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"{source}: missing tokenizer key {key!r}")
    return meta[key]


def _backend(meta: dict[str, Any], source: str):
    from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, normalizers
    from tokenizers import processors

    kind = _field(meta, "tokenizer.ggml.model", source)
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported (gpt2 byte-level BPE only)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_FAMILIES:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; "
                                    f"supported: {', '.join(sorted(_PRE_FAMILIES))}")
    family, ignore_merges = _PRE_FAMILIES[pre]
    tokens = _field(meta, "tokenizer.ggml.tokens", source)
    merges = [tuple(m.split(" ", 1)) for m in _field(meta, "tokenizer.ggml.merges", source)]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = _pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()
    if family == "qwen2":
        backend.normalizer = normalizers.NFC()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return backend, tokens


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    """The tokenizer a GGUF file describes (vocabulary, merges, token types, pre-tokenizer)."""
    backend, tokens = _backend(meta, source)

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    eos = tuple(int(meta[k]) for k in ("tokenizer.ggml.eos_token_id",
                                       "tokenizer.ggml.eot_token_id",
                                       "tokenizer.ggml.eom_token_id") if meta.get(k) is not None)
    return Tokenizer(
        backend,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                        "unk_token": token("unknown_token_id"),
                        "pad_token": token("padding_token_id")},
    )
