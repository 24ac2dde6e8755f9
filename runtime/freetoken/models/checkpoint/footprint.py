"""Device bytes of a checkpoint's weights, from its tensor table alone (nothing is read or
placed), so the memory plan can count each weight in the format it keeps on the device.

A source that can tell offers ``stored(name) -> StoredTensor | None`` beside ``get`` (the GGUF
reader from its tensor table, the HF reader from the safetensors headers); ``weight_bytes``
then applies the placement rules of weights.py to each tensor:

- GGUF blocks the device's kernels read (``Placement.keeps``) count at their file bytes (on a
  GPU each row padded to whole 16-byte words, as weights.gpu_rows places them); other block
  types are dequantized at load and count at the activation dtype's bytes;
- FP8/NVFP4 weights count at their values plus their scales where a kernel takes their layout
  (``Placement.keeps_scaled``: a GPU, or FP8 in a float32 CPU model), else (NVFP4 on the CPU,
  an odd scale layout, an embedding) at the dtype's bytes;
- float tensors count at the dtype's bytes;
- routed experts follow ``_Reader.stacked`` and ``_moe_mlp``: one layer's stacked experts stay
  in their format only as a whole (``Placement.keeps_experts`` for GGUF,
  ``keeps_scaled`` for FP8/NVFP4, offloaded or not), else become floats.

A checkpoint's multi-token-prediction block (a source's ``mtp()`` view, forward/mtp.py) counts
with the weights that are always resident, its routed experts included (never offloaded).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.models.checkpoint.weights import Placement
from freetoken.models.config import ModelConfig
from freetoken.models.quant.scaled import FORMATS, FP8, NVFP4
from freetoken.models.registry import ATTENTION_PARTS, DENSE_MLP_PARTS, LAYER_PARTS, MOE_PARTS

FLOAT, GGUF = "float", "gguf"
_ITEM = {"float32": 4, "bfloat16": 2, "float16": 2}
_EXPERT_PARTS = ("experts.gate", "experts.up", "experts.down")
# rope_freqs stays in host memory (the rope tables are built from it once)
_GLOBALS = ("embed", "lm_head", "final_norm")
_MTP_GLOBALS = ("mtp.fc", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm")
_MTP_LAYER_PARTS = tuple(p for p in ATTENTION_PARTS + DENSE_MLP_PARTS + MOE_PARTS
                         if not p.startswith("experts."))


@dataclass(frozen=True)
class StoredTensor:
    """One canonical tensor as the checkpoint stores it, without its data."""

    shape: tuple[int, ...]      # logical [..., rows, cols], as ``get`` would return it
    kind: str                   # FLOAT, GGUF, or a scaled format (scaled.FP8, scaled.NVFP4)
    nbytes: int                 # in its format: GGUF blocks; scaled: values + scales
    qtype: int = -1             # GGML type id of a GGUF tensor
    kernel_ready: bool = True   # scaled: the GPU kernels take its scale layout

    @property
    def numel(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights on a device, in the bytes of the format each keeps there.

    other: every weight but the routed experts. experts: the routed experts of every MoE
    layer where they would stay resident beside the rest (None: the reader could not tell).
    blocks: some layer weight stays in GGUF blocks (a GPU then plans prefill's dequantizing
    scratch, forward/dequant.py). expert_slot: where every MoE layer's experts keep their
    format, one slot of an expert offload pool: GGUF blocks (engine/expert_pool.BlockPool:
    the widest layer's expert, in 256-byte steps) or FP8/NVFP4 (ScaledPool: an expert's
    values, scales and a float32 row scale per row); None where offloaded experts are floats."""

    other: int
    experts: int | None
    blocks: bool = False
    expert_slot: int | None = None


def weight_bytes(src, cfg: ModelConfig, where: Placement) -> WeightBytes | None:
    """The weights of `cfg` from source `src` as `where` places them; None when the source
    cannot describe its tensors (the plan then counts every parameter at the dtype)."""
    stored = getattr(src, "stored", None)
    if stored is None:
        return None
    seen: set[str] = set()
    other = 0
    names = [n for n in _GLOBALS if not (n == "lm_head" and cfg.tie_word_embeddings)]
    names += [f"layers.{i}.{part}" for i in range(cfg.num_layers) for part in LAYER_PARTS
              if not part.startswith("experts.")]
    blocks = False
    for name in names:
        tensor = stored(name)
        if tensor is None or src.file_name(name) in seen:  # absent, or two names of one tensor
            continue
        seen.add(src.file_name(name))
        other += placed_bytes(tensor, where, lookup=name == "embed")
        blocks |= (name.startswith("layers.") and tensor.kind == GGUF
                   and where.keeps(tensor.qtype))
    other += mtp_bytes(src, cfg, where)
    experts, slot = _routed_expert_bytes(stored, cfg, where)
    blocks |= cfg.moe is not None and any(
        t is not None and t.kind == GGUF and where.keeps_experts(t.qtype)
        for t in (stored(f"layers.{i}.experts.gate") for i in range(cfg.num_layers)))
    return WeightBytes(other, experts, blocks, slot)


def mtp_bytes(src, cfg: ModelConfig, where: Placement) -> int:
    """The MTP block's weights as forward/mtp.py places them (0 without one): every tensor
    of its view, its routed experts resident whatever `where` says of the target's."""
    view = getattr(src, "mtp", None)
    view = view() if view is not None else None
    if view is None:
        return 0
    layers = max(cfg.mtp_num_hidden_layers, 1)
    names = list(_MTP_GLOBALS) + [f"layers.{k}.{part}" for k in range(layers)
                                  for part in _MTP_LAYER_PARTS]
    seen: set[str] = set()
    total = 0
    for name in names:
        tensor = view.stored(name)
        if tensor is None or view.file_name(name) in seen:
            continue
        seen.add(view.file_name(name))
        total += placed_bytes(tensor, where)
    for k in range(layers):
        parts = [view.stored(f"layers.{k}.{part}") for part in _EXPERT_PARTS]
        if None not in parts:
            total += layer_expert_bytes(parts, where)
    return total


def _routed_expert_bytes(stored, cfg: ModelConfig,
                         where: Placement) -> tuple[int | None, int | None]:
    """(every MoE layer's stacked experts in bytes, the offload pool's slot or None)."""
    if cfg.moe is None:
        return 0, None
    total, widest, kinds = 0, 0, set()
    for i in range(cfg.num_layers):
        if not cfg.is_sparse(i):
            continue
        parts = [stored(f"layers.{i}.{part}") for part in _EXPERT_PARTS]
        if None in parts:       # a layout this reader cannot describe: count at the dtype
            return None, None
        layer = layer_expert_bytes(parts, where)
        total += layer
        gate_up, down = _expert_kind(parts[:2], where), _expert_kind(parts[2:], where)
        kinds.add(gate_up if gate_up == down else FLOAT)
        widest = max(widest, -(-layer // cfg.moe.num_experts))
    return total, _slot_bytes(kinds, widest, cfg)


def _slot_bytes(kinds: set[str], widest: int, cfg: ModelConfig) -> int | None:
    """One slot of the offload pool that keeps the experts' format, for MoE layers of `kinds`
    whose widest expert takes `widest` bytes; None where offloaded experts become floats."""
    if not widest or len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind == GGUF:            # BlockPool: one uint8 row a slot, in 256-byte steps
        return -(-widest // 256) * 256
    if kind == FP8:             # ScaledPool: beside the values and grids, the row scales the
        # kernel reads (ones where the checkpoint has none), float32 per gate/up and down row
        return widest + 4 * (2 * cfg.moe.intermediate_size + cfg.hidden_size)
    if kind == NVFP4:           # its stored bytes hold the float32 row scales already
        return widest
    return None


def placed_bytes(tensor: StoredTensor, where: Placement, lookup: bool = False) -> int:
    """Bytes of one matrix (or vector) placed per weights._place; `lookup`: the embedding,
    read by row, which a scaled checkpoint's embedding turns into floats for."""
    if tensor.kind == GGUF and where.keeps(tensor.qtype):
        return _block_bytes(tensor, where)
    if tensor.kind in FORMATS and not lookup and where.keeps_scaled(tensor.kind,
                                                                     tensor.kernel_ready):
        return tensor.nbytes
    return tensor.numel * _ITEM[where.dtype]


def layer_expert_bytes(parts: list[StoredTensor], where: Placement) -> int:
    """One MoE layer's stacked experts [gate, up, down] as the reader places them: gate/up
    (joined) and down each in their format when both keep one, else both floats."""
    gate_up, down = _expert_kind(parts[:2], where), _expert_kind(parts[2:], where)
    if gate_up != down:     # one kernel call takes both: one kind, else floats for both
        gate_up = down = FLOAT
    kinds = (gate_up, gate_up, down)
    return sum(p.numel * _ITEM[where.dtype] if kind == FLOAT else
               _block_bytes(p, where) if kind == GGUF else p.nbytes
               for p, kind in zip(parts, kinds))


def _block_bytes(tensor: StoredTensor, where: Placement) -> int:
    """GGUF blocks as placed: the file's rows on the CPU; on a GPU each row padded with zeros
    to whole 16-byte words (weights.gpu_rows: Q6_K rows of 3 blocks are 630 bytes, 640 there)."""
    if where.arrays.device.is_cpu:
        return tensor.nbytes
    rows = tensor.numel // tensor.shape[-1]
    row_bytes = tensor.nbytes // rows
    return rows * (row_bytes + -row_bytes % 16)


def _expert_kind(parts: list[StoredTensor], where: Placement) -> str:
    """The kind stacked experts keep (mirrors _Reader.stacked): a scaled format where
    keeps_scaled says so, GGUF blocks where keeps_experts says so, else floats."""
    first = parts[0]
    if all(p.kind == first.kind for p in parts) and first.kind in FORMATS and \
            all(where.keeps_scaled(p.kind, p.kernel_ready) for p in parts):
        return first.kind
    if all(p.kind == GGUF for p in parts) and len({p.qtype for p in parts}) == 1 and \
            where.keeps_experts(first.qtype):
        return GGUF
    return FLOAT
