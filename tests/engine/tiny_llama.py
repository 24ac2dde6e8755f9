"""A tiny random HF llama with a byte-level tokenizer, written with transformers/tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONTEXT = 512


def write_tokenizer(directory: Path) -> int:
    """A byte-level BPE with no merges: 256 byte tokens, then the ChatML specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
    return tok.get_vocab_size()


def write_tiny_llama(directory: Path) -> None:
    """2 layers, random weights scaled up so greedy choices have clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = write_tokenizer(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=None,
                         initializer_range=0.3)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab - 1}))
