"""Prefix-cache keys: a full KV page is named by a hash chain over every token up to its end.

Page j's key hashes page j-1's key with page j's token ids, and the chain starts from the model's
id, so two sequences share page j exactly when their first (j + 1) * block_size tokens agree on
the same model. Edits fall out of this: a client that rewrites or drops a middle part of its
history still reuses every full page before the first changed token; the page holding that
token and everything after it are recomputed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16  # 128-bit keys: a collision would silently serve another prompt's KV


def root_key(model_id: str) -> bytes:
    """The chain's start for one model (its id, KV dtype: whatever makes KV incompatible)."""
    return hashlib.blake2b(f"freetoken-prefix|{model_id}".encode(),
                           digest_size=DIGEST_BYTES).digest()


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def extend_keys(keys: list[bytes], token_ids: Sequence[int], num_tokens: int,
                block_size: int, root: bytes) -> list[bytes]:
    """Append to `keys` (the keys of token_ids' first full pages, in order) the keys of the
    remaining full pages within the first `num_tokens` tokens; returns `keys`."""
    for j in range(len(keys), num_tokens // block_size):
        parent = keys[-1] if keys else root
        keys.append(page_key(parent, token_ids[j * block_size:(j + 1) * block_size]))
    return keys
