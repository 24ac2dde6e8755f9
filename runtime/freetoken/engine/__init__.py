"""Paged-KV engine with continuous batching, chunked prefill and sampling."""

__all__ = [
    "config",
    "detokenizer",
    "engine",
    "guide",
    "kv_pool",
    "prepare",
    "request",
    "sampling",
    "scheduler",
    "stream",
]
