"""Tensor parallelism: a model split over N processes (one per GPU, or CPU processes) whose
collectives come from torch.distributed (gloo, NCCL, RCCL)."""

__all__ = ["front", "graphs", "group", "launch", "load", "options", "rank", "shard", "start",
           "worker"]
