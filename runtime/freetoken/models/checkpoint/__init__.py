"""Reading checkpoints: HF safetensors folders and GGUF files into configs and weights."""

__all__ = ["default", "gguf", "gguf_config", "gguf_file", "gguf_split", "hf", "hf_config",
           "weights"]
