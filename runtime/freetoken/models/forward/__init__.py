"""The forward pass: decoder layers (attention, dense and MoE MLPs) over preallocated buffers."""

__all__ = ["decoder", "kernels", "linear", "moe", "rope", "workspace"]
