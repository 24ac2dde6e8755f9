"""SentencePiece BPE vocabularies (GGUF `tokenizer.ggml.model = llama`) as a `tokenizers` BPE.

The file holds pieces with scores and token types but no merges. SentencePiece BPE joins, again
and again, the adjacent pair whose joined piece scores highest; a `tokenizers` BPE applies the
lowest-ranked merge first. So every way to cut a piece into two vocabulary pieces becomes a
merge, ranked by the piece's score. Spaces are spelled "▁" and characters without a piece are
spelled as <0xNN> byte pieces.

Whitespace follows llama.cpp (and the tokenizer.json these models were trained with): a space is
put before every run of text, at the start and after each special or user-defined token, even
when the text already starts with a space (" Hi" -> "▁▁Hi"); decoding drops that one space at
the start of the text.
"""

from __future__ import annotations

from typing import Any

from freetoken.models.errors import ModelFormatError, UnsupportedModelError

# GGML token types (llama.cpp).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"

# These architectures store SentencePiece vocabularies under other rules (merge order by file
# position, whitespace pieces spelled with spaces, a normalizer-made prefix); refuse rather than
# tokenize them subtly wrong.
_OTHER_RULES = ("gemma", "gemma2", "phi3")


def _per_token(meta: dict[str, Any], key: str, count: int, source: str) -> list | None:
    """The list under `key`, one entry per token; None when the key is absent."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != count:
        size = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise ModelFormatError(f"{source}: {key} has {size} entries but tokenizer.ggml.tokens "
                               f"has {count}; the file's vocabulary is inconsistent, re-convert it")
    return list(value)


def derive_merges(tokens: list[str], scores: list[float],
                  types: list[int]) -> list[tuple[str, str]]:
    """Merges implied by the vocabulary, best first.

    Only normal pieces are merge results: SentencePiece matches user-defined pieces whole and
    never builds control, unknown, unused or byte pieces. Among merges of equal score the one
    with the longer left part, then the longer right part, then the earlier piece goes first
    (SentencePiece would take the leftmost pair in the text, which fixed ranks cannot express;
    real vocabularies give their pieces distinct scores).
    """
    known = set(tokens)
    ranked = []
    for index, piece in enumerate(tokens):
        if types[index] != NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in known and right in known:
                ranked.append((-scores[index], -cut, cut - len(piece), index, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def token_types(meta: dict[str, Any], tokens: list[str], source: str) -> list[int] | None:
    """tokenizer.ggml.token_type checked against the vocabulary (None when the file has none)."""
    return _per_token(meta, "tokenizer.ggml.token_type", len(tokens), source)


def sentencepiece_backend(meta: dict[str, Any], tokens: list[str], source: str):
    """A `tokenizers` Tokenizer (model, normalizer, decoder) for a SentencePiece vocabulary.

    Raises ModelFormatError when tokenizer.ggml.scores is missing or does not match the
    vocabulary, UnsupportedModelError for architectures whose files follow other rules.
    """
    from tokenizers import Tokenizer as Backend, models

    arch = meta.get("general.architecture")
    if arch in _OTHER_RULES:
        raise UnsupportedModelError(
            f"{source}: SentencePiece vocabularies of architecture {arch!r} are not supported")
    scores = _per_token(meta, "tokenizer.ggml.scores", len(tokens), source)
    if scores is None:
        raise ModelFormatError(f"{source}: missing tokenizer key 'tokenizer.ggml.scores', which a "
                               f"SentencePiece (llama) vocabulary needs to rank its merges")
    types = token_types(meta, tokens, source) or [NORMAL] * len(tokens)
    unk = _unknown_piece(meta, tokens, types)
    model = models.BPE({t: i for i, t in enumerate(tokens)}, derive_merges(tokens, scores, types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.normalizer = _whitespace_normalizer(prefix)
    backend.decoder = _whitespace_decoder(prefix)
    return backend


def _unknown_piece(meta: dict[str, Any], tokens: list[str], types: list[int]) -> str | None:
    index = meta.get("tokenizer.ggml.unknown_token_id")
    if index is None:
        index = next((i for i, kind in enumerate(types) if kind == UNKNOWN), None)
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None


def _whitespace_normalizer(prefix: bool):
    """Spaces become "▁", with one more before the text. `tokenizers` normalizes each run of
    text between added tokens on its own, so the prefix also follows every special token, as
    llama.cpp puts it there. No pre-tokenizer: SentencePiece merges across word boundaries."""
    from tokenizers import normalizers

    steps = [normalizers.Replace(" ", SPACE)]
    if prefix:
        steps.insert(0, normalizers.Prepend(SPACE))
    return normalizers.Sequence(steps)


def _whitespace_decoder(prefix: bool):
    """Spaces back from "▁", byte pieces to bytes, then (with the prefix) the one space at the
    start of the whole text dropped; a window of a longer text loses its first space the same
    way whether or not more ids follow, so streaming by windows stays exact."""
    from tokenizers import decoders

    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:   # after Fuse the text is one string: strip at most one space at its start
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)
