"""Kernel loading: the cache wheel first, JIT only where allowed."""

__all__ = ["errors", "loader", "ops", "reference", "targets"]
