"""Paged-KV engine with continuous batching, chunked prefill and sampling."""

__all__ = [
    "config",
    "detokenizer",
    "engine",
    "guide",
    "kv_pool",
    "prefix_cache",
    "prepare",
    "request",
    "sampling",
    "scheduler",
    "stream",
]
