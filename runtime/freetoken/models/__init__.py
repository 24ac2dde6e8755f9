"""Models: the architecture registry, checkpoint readers, tokenizers and the forward pass."""

__all__ = ["batch", "checkpoint", "config", "errors", "forward", "hub", "loader", "registry",
           "resolve", "tokenizer"]
