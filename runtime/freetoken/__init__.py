"""FreeToken: an edge LLM serving engine with ahead-of-time compiled kernels."""

__version__ = "0.1.0"

__all__ = ["__version__"]
