"""The `ft` command line."""

__all__ = ["main"]
