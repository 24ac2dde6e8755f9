"""A placeholder byte-level BPE vocabulary for random-weight GGUF files.

Benchmarks feed token ids, so the vocabulary only has to be one that llama.cpp and FreeToken
both accept at the model's vocabulary size: `gpt2` (byte-level BPE) with the Qwen2
pre-tokenizer, the 256 byte symbols first (so any text encodes, "\\n" included), a few merges,
numbered filler tokens up to the size, and Qwen's three control tokens at the end
(``<|endoftext|>`` is BOS, ``<|im_end|>`` EOS, no BOS added to prompts).
"""

from __future__ import annotations

NORMAL, CONTROL = 1, 3     # gguf.TokenType values
# (left, right) pairs; each result is a vocabulary entry, so the BPE model is well formed
MERGES = (("Ġ", "t"), ("Ġ", "a"), ("h", "e"), ("i", "n"), ("r", "e"), ("o", "n"),
          ("Ġt", "he"), ("e", "r"), ("Ġ", "s"), ("a", "t"))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's own templates render plain messages: both servers can then serve the file
# through their chat endpoints (load benchmarks send chat requests)
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_symbols() -> list[str]:
    """The 256 byte-level symbols in byte order (GPT-2's reversible byte -> character map:
    printable Latin-1 bytes stand for themselves, the others move to U+0100 onwards)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted, symbols = 0, []
    for b in range(256):
        if b in kept:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def placeholder_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a vocabulary of exactly `size` tokens."""
    base = byte_symbols() + [left + right for left, right in MERGES]
    if size < len(base) + len(SPECIALS):
        raise ValueError(f"a placeholder vocabulary needs at least "
                         f"{len(base) + len(SPECIALS)} tokens, got {size}")
    fillers = [f"tok{i}" for i in range(len(base), size - len(SPECIALS))]
    tokens = base + fillers + list(SPECIALS)
    types = [NORMAL] * (size - len(SPECIALS)) + [CONTROL] * len(SPECIALS)
    return tokens, types, [f"{left} {right}" for left, right in MERGES]


def add_placeholder_vocab(writer, size: int) -> None:
    """Write the tokenizer.ggml.* keys of `placeholder_vocab(size)` with a gguf GGUFWriter
    (the installed `gguf` package or the one beside llama.cpp's converter)."""
    tokens, types, merges = placeholder_vocab(size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(size - 3)
    writer.add_eos_token_id(size - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
