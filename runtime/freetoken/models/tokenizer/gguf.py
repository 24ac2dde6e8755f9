"""A `tokenizers` tokenizer rebuilt from GGUF vocabulary metadata (tokenizer.ggml.*): byte-level
BPE with merges (`gpt2`) here, SentencePiece BPE (`llama`) in gguf_spm."""

from __future__ import annotations

from typing import Any

from freetoken.models.errors import ModelFormatError, UnsupportedModelError
from freetoken.models.tokenizer.builtin_templates import gguf_chat_template
from freetoken.models.tokenizer.gguf_spm import (CONTROL, NORMAL, UNKNOWN, USER_DEFINED,
                                       sentencepiece_backend, token_types)
from freetoken.models.tokenizer.core import Tokenizer

# Split patterns of the pre-tokenizer families, as their vocabularies were trained.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5/3.6: Qwen2's split with combining marks (\p{M}) kept inside words
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> (family, BPE ignore_merges)
_PRE_FAMILIES = {
    "default": ("gpt2", False), "gpt-2": ("gpt2", False), "gpt2": ("gpt2", False),
    "smollm": ("digits", False), "starcoder": ("digits", False), "refact": ("digits", False),
    "codeshell": ("digits", False),
    "llama-bpe": ("llama3", True), "llama3": ("llama3", True), "llama-v3": ("llama3", True),
    "smaug-bpe": ("llama3", True), "dbrx": ("llama3", True), "falcon3": ("llama3", True),
    "qwen2": ("qwen2", False), "deepseek-r1-qwen": ("qwen2", False),
    "qwen35": ("qwen35", False),
}


def _pre_tokenizer(family: str):
    from tokenizers import Regex, pre_tokenizers

    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":   # every digit on its own, then the GPT-2 split
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"llama3": _LLAMA3_SPLIT, "qwen35": _QWEN35_SPLIT}.get(family, _QWEN2_SPLIT)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _field(meta: dict[str, Any], key: str, source: str) -> Any:
    if key not in meta:
        raise ModelFormatError(f"{source}: missing tokenizer key {key!r}")
    return meta[key]


def _byte_level_backend(meta: dict[str, Any], tokens: list[str], source: str):
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_FAMILIES:
        raise UnsupportedModelError(f"{source}: tokenizer.ggml.pre {pre!r} is not supported; "
                                    f"supported: {', '.join(sorted(_PRE_FAMILIES))}")
    family, ignore_merges = _PRE_FAMILIES[pre]
    merges = [tuple(m.split(" ", 1)) for m in _field(meta, "tokenizer.ggml.merges", source)]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = _pre_tokenizer(family)
    backend.decoder = decoders.ByteLevel()
    if family in ("qwen2", "qwen35"):
        backend.normalizer = normalizers.NFC()
    return backend


def _add_vocabulary_tokens(backend, meta: dict[str, Any], tokens: list[str], source: str) -> None:
    """Control and unknown tokens become special added tokens, user-defined ones plain added
    tokens (both are matched whole in the text, never split)."""
    from tokenizers import AddedToken

    types = token_types(meta, tokens, source)
    if types is None:   # no types in the file: at least keep its named tokens whole
        named = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown")}
        types = [CONTROL if i in named else NORMAL for i in range(len(tokens))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == USER_DEFINED])


def _framing(meta: dict[str, Any], tokens: list[str], add_bos_default: bool):
    """The post-processor adding BOS/EOS around encoded text, or None when neither is added."""
    from tokenizers import processors

    def named(key: str, flag: str, default: bool) -> tuple[str, int] | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        if not meta.get(f"tokenizer.ggml.{flag}", default) or index is None \
                or not 0 <= index < len(tokens):
            return None
        return tokens[index], index

    bos = named("bos", "add_bos_token", add_bos_default)
    eos = named("eos", "add_eos_token", False)
    if bos is None and eos is None:
        return None

    def framed(segment: str, type_id: int) -> str:
        parts = ([bos[0]] if bos else []) + [segment] + ([eos[0]] if eos else [])
        return " ".join(f"{part}:{type_id}" for part in parts)

    return processors.TemplateProcessing(
        single=framed("$A", 0), pair=f"{framed('$A', 0)} {framed('$B', 1)}",
        special_tokens=[t for t in (bos, eos) if t is not None])


def _backend(meta: dict[str, Any], source: str):
    kind = _field(meta, "tokenizer.ggml.model", source)
    if kind not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2 "
            f"(byte-level BPE), llama (SentencePiece BPE)")
    tokens = _field(meta, "tokenizer.ggml.tokens", source)
    if kind == "gpt2":
        backend = _byte_level_backend(meta, tokens, source)
    else:
        backend = sentencepiece_backend(meta, tokens, source)
    _add_vocabulary_tokens(backend, meta, tokens, source)
    # llama.cpp adds a BOS to SentencePiece text unless the file says otherwise.
    framing = _framing(meta, tokens, add_bos_default=kind == "llama")
    if framing is not None:
        backend.post_processor = framing
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
        chat_template=gguf_chat_template(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        special_tokens={"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                        "unk_token": token("unknown_token_id"),
                        "pad_token": token("padding_token_id")},
    )
