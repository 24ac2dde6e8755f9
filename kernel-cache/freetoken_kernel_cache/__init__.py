"""Precompiled FreeToken kernels: the companion wheel of the `freetoken` runtime."""

from pathlib import Path

__version__ = "0+unbuilt"  # written by the build backend

__all__ = ["__version__", "get_cache_dir"]


def get_cache_dir() -> str:
    """The folder holding index.json and <target>/<key>.so files."""
    return str(Path(__file__).resolve().parent / "cache")
