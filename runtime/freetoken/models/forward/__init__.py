"""The forward pass: decoder layers (attention, dense and MoE MLPs) over preallocated buffers."""

__all__ = ["attention", "decoder", "kernels", "linear", "mlp", "rope", "workspace"]
