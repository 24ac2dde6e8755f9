"""Model loading (GGUF, HF safetensors, the embedded default) and the dense decoder forward."""

__all__ = ["batch", "chat_template", "config", "default", "dense", "errors", "gguf_loader",
           "gguf_tokenizer", "hf_loader", "linear", "loader", "registry", "rope",
           "tokenizer", "weights", "workspace"]
