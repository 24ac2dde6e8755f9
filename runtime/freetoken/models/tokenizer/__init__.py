"""Tokenizers: HF tokenizer.json, GGUF vocabularies, and chat templates."""

__all__ = ["chat_template", "core", "gguf", "gguf_spm", "hf"]
