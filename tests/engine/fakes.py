"""A tiny model that really uses the paged KV pool, and a character tokenizer.

The model stores each input token id in its K pool, then for every sequence reads the whole
context back through block_tables and predicts next = (sum(context) * 7 + len(context)) % vocab.
`expected_continuation` computes the same rule straight from the token list, so any paging or
batching mistake (a wrong slot, a page shared by two sequences) changes the output.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from freetoken.arrays import HostArrays
from freetoken.models.batch import ForwardBatch, KVCache
from freetoken.models.config import ModelConfig

ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?"


def next_token(context: list[int], vocab: int) -> int:
    return (sum(context) * 7 + len(context)) % vocab


def repeating_token(context: list[int], vocab: int, period: int = 5) -> int:
    """A rule prompt lookup can draft for: the context repeats with `period`, except that
    every 11th token follows next_token (a draft crossing it is rejected)."""
    if len(context) % 11 == 0 or len(context) < period:
        return next_token(context, vocab)
    return context[-period]


def expected_continuation(prompt: list[int], count: int, vocab: int,
                          eos: int | None = None, rule=next_token) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(count):
        token = rule(tokens, vocab)
        out.append(token)
        tokens.append(token)
        if token == eos:
            break
    return out


class FakeModel:
    def __init__(self, vocab: int = len(ALPHABET), max_position: int = 4096, rule=next_token):
        self.config = ModelConfig(
            architecture="llama", vocab_size=vocab, hidden_size=4, intermediate_size=4,
            num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, rms_norm_eps=1e-5,
            rope_theta=1e4, max_position=max_position)
        self.arrays = HostArrays()
        self.device = self.arrays.device
        self.dtype = "float32"
        self.batches: list[ForwardBatch] = []
        self.fail_next = False
        self.gate = threading.Event()   # forward waits while it is clear
        self.gate.set()
        self.step_seconds = 0.0         # a floor on each forward's time (a slow model)
        self.draft_row_seconds = 0.0    # and per draft token verified (a costly verify step)
        self.rule = rule                # next token from the context (next_token by default)

    def forward(self, batch: ForwardBatch, kv: KVCache) -> np.ndarray:
        self.batches.append(batch)
        self.gate.wait()
        if self.step_seconds or self.draft_row_seconds:
            drafts = batch.logits_indices.shape[0] - batch.num_seqs
            time.sleep(self.step_seconds + self.draft_row_seconds * max(drafts, 0))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        kv.k[0][batch.slot_mapping, 0, 0] = batch.input_ids.astype(np.float32)
        # a row per logits index: a sequence's last token, or (verify steps) each of its tokens
        logits = np.zeros((batch.logits_indices.shape[0], self.config.vocab_size),
                          dtype=np.float32)
        block = kv.block_size
        for i, row in enumerate(batch.logits_indices.tolist()):
            b = int(np.searchsorted(batch.query_start_loc, row, side="right")) - 1
            n = int(batch.seq_lens[b]) - (int(batch.query_start_loc[b + 1]) - 1 - row)
            pos = np.arange(n)
            slots = batch.block_tables[b, pos // block].astype(np.int64) * block + pos % block
            context = kv.k[0][slots, 0, 0].astype(np.int64).tolist()
            logits[i, self.rule(context, self.config.vocab_size)] = 10.0
        return logits


class CharTokenizer:
    """id i <-> ALPHABET[i]; ids past the alphabet decode to nothing (special tokens)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ALPHABET.index(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids if i < len(ALPHABET))
