"""Decode CUDA graphs under tensor parallelism: rank 0 captures its own over its shard while
every other rank captures the same sizes in the same order (its worker was told to), so the
NCCL collectives recorded in each graph meet; a replay on rank 0 first sends the batch, and
the other ranks replay their graph of the same size."""

from __future__ import annotations

from freetoken.engine.cuda_graph import DecodeGraphs
from freetoken.parallel.worker import describe_batch


class ShardedGraphs(DecodeGraphs):
    def __init__(self, front, kv, max_batch: int, max_blocks: int):
        super().__init__(front.rank, kv, max_batch, max_blocks)
        self.front = front

    def run(self, batch, previous_tokens=None):
        # NOTE: overlap scheduling (placeholder ids filled on the device) is off under tensor
        # parallelism: the other ranks never see rank 0's sampled tokens.
        assert previous_tokens is None, "overlap scheduling is off under tensor parallelism"
        self.front.ranks.send(("replay", describe_batch(batch, self.front.arrays.host)))
        logits = super().run(batch)
        self.front.ranks.steps[0] += 1
        return logits
