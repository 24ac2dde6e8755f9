"""Models named by Hugging Face Hub repository (ORG/NAME[:QUANT]), fetched into its cache."""

__all__ = ["architecture", "errors", "fetch", "files", "gguf_pick", "listing", "pull",
           "reference"]
