__all__ = ["scaled"]
