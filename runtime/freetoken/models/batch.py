"""What one forward step reads: token ids, positions and the paged-KV addressing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from freetoken.arrays import HostArrays, TorchArrays
from freetoken.models.config import ModelConfig

Array = Any  # numpy on the CPU, torch on a GPU


@dataclass
class ForwardBatch:
    """One step over B sequences with T new tokens in total; every array on the model device.

    Sequence b owns tokens query_start_loc[b]:query_start_loc[b+1] of the flat token axis;
    after the step it holds seq_lens[b] tokens; its pages are block_tables[b, :].
    """

    input_ids: Array        # int64 [T]
    positions: Array        # int64 [T]
    slot_mapping: Array     # int64 [T]  page * block_size + offset, per new token
    block_tables: Array     # int32 [B, max_blocks]
    seq_lens: Array         # int32 [B]
    query_start_loc: Array  # int32 [B+1]
    logits_indices: Array   # int64 [R]  rows of T whose logits are returned (R = B: last tokens)
    max_query_len: int = 1         # host-side hint: 1 means a pure decode step
    state_slots: Array | None = None   # int32 [B] hybrid models: recurrent-state slot per seq
    multimodal: MultimodalBatch | None = None   # host side: the step's image tokens, if any

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class MultimodalBatch:
    """The image tokens of one step. Their positions index the rotary table's spare rows
    (forward/mrope.py), which the step fills from `rope_positions`; their embedding rows are
    replaced by the vision tower's output."""

    rope_positions: Any                  # int64 [K, 3] numpy: (t, h, w) per spare row used
    pieces: list = field(default_factory=list)   # (token row, prompt, image, first, count)
    embeds: list = field(default_factory=list)   # (token row, [count, hidden] on the device)


FP8_KV = "fp8"   # the KV dtype name of the FP8 pool (Fp8Pool)


@dataclass
class Fp8Pool:
    """One layer's K or V pool in FP8 (kernels/include/freetoken/fp8_encode.h): e4m3 codes
    uint8 [S, Hk, D] and one float32 scale per (slot, KV head) [S, Hk], the row's largest
    magnitude / 448, fixed when its token is written. Slicing the slot axis slices both, so
    code that copies pools (live resize) treats it as one array."""

    codes: Any
    scales: Any

    @property
    def shape(self) -> tuple:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes) + int(self.scales.nbytes)   # numpy and torch alike

    def __getitem__(self, slots) -> Fp8Pool:
        return Fp8Pool(self.codes[slots], self.scales[slots])

    def __setitem__(self, slots, other: Fp8Pool) -> None:
        self.codes[slots] = other.codes
        self.scales[slots] = other.scales

    def map(self, fn) -> Fp8Pool:
        """The pool with `fn` applied to both arrays (e.g. as kernel arguments)."""
        return Fp8Pool(fn(self.codes), fn(self.scales))


def kv_bytes_per_element(dtype: str, head_dim: int) -> float:
    """Bytes a K or V pool keeps per element: the dtype's, or FP8's byte plus its share of the
    row's float32 scale."""
    if dtype == FP8_KV:
        return 1 + 4 / head_dim
    return 4 if dtype == "float32" else 2


class KVCache:
    """Per-layer K and V pools of `num_blocks * block_size` slots: [S, Hk, D] each (an Fp8Pool
    per layer and side with dtype "fp8").

    A hybrid model's GDN layers keep no K/V: their k entry is the conv state [N, C, K-1]
    (activation dtype) and their v entry the delta-rule state f32 [N, Hv, dk, dv], for
    `num_state_slots` = N sequences at once (one slot per running sequence)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: str,
                 arrays: HostArrays | TorchArrays, num_state_slots: int = 0,
                 state_dtype: str | None = None):
        slots = num_blocks * block_size
        shape = (slots, config.num_kv_heads, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots if config.linear is not None else 0
        # Attention reads only slots written earlier, so the CPU pool is left uninitialised:
        # the OS maps its pages on first write (fast start, RSS grows with use). CUDA graphs
        # may read padding slots, which must hold finite values: zero them there.
        def alloc():
            if dtype == FP8_KV:
                pool = Fp8Pool(arrays.empty(shape, "uint8"), arrays.empty(shape[:2], "float32"))
                if not arrays.device.is_cpu:
                    pool.codes.zero_()
                    pool.scales.fill_(1.0)
                return pool
            pool = arrays.empty(shape, dtype)
            if not arrays.device.is_cpu:
                pool.zero_()
            return pool

        self.k = [alloc() for _ in config.kv_layers]
        self.v = [alloc() for _ in config.kv_layers]
        if config.linear is not None:   # conv states hold activations: the model's dtype
            fallback = "float32" if dtype == FP8_KV else dtype
            self._add_states(config, state_dtype or fallback, arrays)

    def _add_states(self, config: ModelConfig, dtype: str,
                    arrays: HostArrays | TorchArrays) -> None:
        """Interleave the GDN layers' states into k/v at their layer index (zeroed: a state
        is read only after a sequence's first chunk wrote it, but graph padding may not be)."""
        lin, n = config.linear, max(self.num_state_slots, 1)
        k, v = iter(self.k), iter(self.v)
        self.k, self.v = [], []
        for layer in range(config.num_layers):
            if not config.is_linear(layer):
                self.k.append(next(k))
                self.v.append(next(v))
                continue
            conv = arrays.empty((n, lin.conv_dim, lin.conv_kernel - 1), dtype)
            ssm = arrays.empty((n, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim), "float32")
            conv[...] = 0
            ssm[...] = 0
            self.k.append(conv)
            self.v.append(ssm)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: str) -> int:
        item = kv_bytes_per_element(dtype, config.head_dim)
        return round(2 * len(config.kv_layers) * config.kv_size * item)

    @staticmethod
    def bytes_per_state_slot(config: ModelConfig, dtype: str) -> int:
        """Recurrent state of one sequence over every GDN layer (0 without GDN layers)."""
        if config.linear is None:
            return 0
        item = 4 if dtype == "float32" else 2
        return sum(config.linear_layers) * config.linear.state_bytes(item)
