"""The GPU decode step (up to 4 tokens) in fewer launches: fused projections over an un-normed
residual stream.

The unfused forward keeps two buffers in step (residual, and hidden = its norm) and runs, per
dense layer: qkv mm, [2 rms_norm for a per-head q/k norm], rotary, store_kv, attention, o mm,
fused_add_rms_norm, gate_up mm, silu_and_mul, down mm, fused_add_rms_norm: 10 launches (12).
Here the residual alone is carried, and each projection norms its own input:

    decode_gemv        input RMSNorm prologue (+ qkv bias)        <- norm + qkv mm
    rope_store_kv      per-head q/k norm + rotary + KV store      <- [2 norms] + rotary + store
    paged_attention                                               (unchanged)
    decode_gemv_add    residual += o(attn)                        <- o mm + the add
    decode_gemv_swiglu post-attention RMSNorm prologue, SwiGLU    <- norm + gate_up mm + silu
    decode_gemv_add    residual += down(act)                      <- down mm + the add

6 launches per dense layer for steps of 1-2 tokens; 8 at 3-4 tokens, where each RMSNorm runs
as its own kernel (see MAX_TOKENS). A MoE layer fuses its attention half; its MLP runs the routed
kernels on the normed input (rms_norm, router, top-k, experts, then the residual add).
Hybrid models (Qwen3-Next, Qwen3.5/3.6) fuse the same way: a Gated DeltaNet layer runs
decode_gemv (input norm prologue) -> conv -> recurrence -> gated norm -> decode_gemv_add, and a
gated attention layer adds a second normed-input GEMV for its output gate (sigmoid(gate) times
the attention output, then decode_gemv_add) to the dense chain above.
Numerics: every intermediate is rounded to the activation dtype exactly where the unfused chain
stores it, so the two paths differ only in the f32 summation order of the dot products.

With FREETOKEN_QUANT_GEMV=v3, quantized projections take the same chain: GGUF blocks (bf16
activations; every type gguf_gemv_q8 reads, and a qkv of row parts of different types, as the
_M mixes write) through gguf_gemv_q8, whose blocks quantize their input to int8 after the
RMSNorm prologue (quant_gemv.py), for steps of up to what every part reads (2-8 tokens), one launch more
per extra qkv part; FP8 weights through fp8_gemv_fused, at every fused step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from freetoken.arrays import array_view
from freetoken.kernel import ops
from freetoken.models.batch import Array, ForwardBatch, Fp8Pool
from freetoken.models.checkpoint.weights import LayerWeights
from freetoken.models.config import ModelConfig, QuantWeight
from freetoken.models.forward import quant_gemv
from freetoken.models.quant.scaled import FP8, ScaledWeight
from freetoken.models.forward.attention import mul_sigmoid
from freetoken.models.forward.workspace import WorkViews

if TYPE_CHECKING:
    from freetoken.models.forward.decoder import DecoderLayer, Kernels

# How many tokens a step may have to take this path. The GEMV streams each weight once, but its
# f32 work grows with the tokens: per weight, about 1 + 2T instructions (1 + 3.5T with the norm
# prologue, which re-rounds x for every row). An H200 issues ~14 per weight at full HBM
# bandwidth (33 T thread-instructions/s over 2.4 T bf16 weights/s), so the norm rides in the
# prologue up to 2 tokens and runs as its own kernel at 3-4; wider steps take cuBLAS, whose
# tensor cores do the work of 8 tokens at the cost of one.
MAX_TOKENS = 4
NORM_IN_PROLOGUE_TOKENS = 2
# Steps a layer with GGUF projections takes: at least QUANT_MIN_TOKENS (every part must read
# them), up to what every part reads (quant_gemv.q8_max_tokens; 8 for Q4_K, Q6_K and Q8_0 rows
# whose x fits the staging)
QUANT_MIN_TOKENS = 2
# gguf_gemv_q8 and fp8_gemv_fused launched as programmatic dependents (sm_90+): their blocks
# start while the previous kernel drains, as decode_gemv's pdl variants
Q8_PDL = True
_GROUPS = (32, 64, 128, 256)
_BLOCK = 256


def gemv_group(rows: int, k: int, sms: int) -> int:
    """Threads per output row of decode_gemv: the fewest (one warp) unless the grid would leave
    SMs idle; then the K loop is split over more threads of the block (up to 256), as long as
    each thread keeps at least two 16-byte vectors of the row to load."""
    group = _GROUPS[0]
    while (group < _GROUPS[-1] and -(-rows // (_BLOCK // group)) < 2 * sms
           and k // 8 >= 4 * group):
        group *= 2
    return group


@dataclass(frozen=True)
class GemvVariant:
    """One compiled set of decode_gemv's performance knobs: a row of kGemvVariants in
    kernels/include/freetoken/gemv_knobs.cuh, whose index is the kernel's `variant` argument
    (keep the two tables in step; the GPU tests run every row)."""

    threads: int      # per block: group may not exceed it
    unroll: int       # 16-byte weight loads in flight per thread and row
    load: str         # "plain", "no-L1" (ld.global.nc.L1::no_allocate), "no-L1+L2-256B"
    pipelined: bool   # next loads issued before the current math (and before the norm)
    pdl: bool = False  # programmatic dependent launch (sm_90+): starts while the previous
                       # kernel drains, loading weights only until that one has finished


GEMV_VARIANTS = (
    GemvVariant(256, 4, "plain", False),          # 0: the original kernel, the default
    GemvVariant(256, 4, "no-L1", False),
    GemvVariant(256, 4, "no-L1", True),
    GemvVariant(256, 8, "no-L1", True),
    GemvVariant(128, 4, "no-L1", True),
    GemvVariant(256, 8, "no-L1+L2-256B", True),
    GemvVariant(256, 4, "no-L1", True, pdl=True),
    GemvVariant(256, 8, "no-L1", True, pdl=True),
    GemvVariant(128, 4, "no-L1", True, pdl=True),
)


@dataclass(frozen=True)
class GemvChoice:
    """How one projection runs at one token count. 0 / None mean "the rule": group from
    gemv_group, the norm in the prologue up to NORM_IN_PROLOGUE_TOKENS tokens (else rms_norm
    runs first as its own kernel; ignored for the residual-add projections)."""

    variant: int = 0
    group: int = 0
    norm_prologue: bool | None = None


# (projection, N, K, tokens) -> GemvChoice: the fastest measured by benchmarks/gemv_sweep.py
# (which prints this table) on an H200. projection: "qkv" (norm prologue, optional bias), "add"
# (o and down: residual +=), "swiglu" (gate/up, N = I). Unlisted shapes take the rules.
# measured on an NVIDIA H200 by benchmarks/gemv_sweep.py --tokens 1,2 (the old rule -> the
# chosen configuration, per launch)
TUNED: dict[tuple[str, int, int, int], GemvChoice] = {
    ('qkv', 960, 576, 1): GemvChoice(8, 64, norm_prologue=True),  # smollm2 qkv: 3.2 -> 2.8 us
    ('qkv', 960, 576, 2): GemvChoice(6, 64, norm_prologue=True),  # smollm2 qkv: 3.9 -> 3.2 us
    ('add', 576, 576, 1): GemvChoice(6, 64),  # smollm2 o: 2.9 -> 2.4 us
    ('add', 576, 576, 2): GemvChoice(6, 64),  # smollm2 o: 3.4 -> 2.8 us
    ('swiglu', 1536, 576, 1): GemvChoice(8, 32, norm_prologue=True),  # smollm2 gate_up: 4.5 -> 4.0 us
    ('swiglu', 1536, 576, 2): GemvChoice(8, 32, norm_prologue=True),  # smollm2 gate_up: 5.1 -> 4.5 us
    ('add', 576, 1536, 1): GemvChoice(6, 64),  # smollm2 down: 3.4 -> 2.9 us
    ('add', 576, 1536, 2): GemvChoice(6, 64),  # smollm2 down: 3.9 -> 3.5 us
    ('qkv', 6144, 4096, 1): GemvChoice(1, 128, norm_prologue=False),  # qwen3-8b qkv: 26.2 -> 18.3 us
    ('qkv', 6144, 4096, 2): GemvChoice(1, 128, norm_prologue=False),  # qwen3-8b qkv: 31.9 -> 20.9 us
    ('add', 4096, 4096, 1): GemvChoice(1, 32),  # qwen3-8b o: 13.4 -> 12.4 us
    ('add', 4096, 4096, 2): GemvChoice(1, 32),  # qwen3-8b o: 17.6 -> 15.7 us
    ('swiglu', 12288, 4096, 1): GemvChoice(1, 64, norm_prologue=False),  # qwen3-8b gate_up: 66.0 -> 55.0 us
    ('swiglu', 12288, 4096, 2): GemvChoice(1, 64, norm_prologue=False),  # qwen3-8b gate_up: 77.2 -> 59.3 us
    ('add', 4096, 12288, 1): GemvChoice(1, 64),  # qwen3-8b down: 41.4 -> 29.3 us
    ('add', 4096, 12288, 2): GemvChoice(1, 64),  # qwen3-8b down: 57.6 -> 35.1 us
    # Qwen3.6-35B-A3B (benchmarks/results/h200-gemv_sweep-qwen3.6-b53ad0d.txt); its qkv and o
    # shapes are Qwen3-30B-A3B's attention too
    ('qkv', 12352, 2048, 1): GemvChoice(1, 64, norm_prologue=False),  # qwen3.6 gdn_in: 21.9 -> 17.3 us
    ('qkv', 12352, 2048, 2): GemvChoice(1, 64, norm_prologue=False),  # qwen3.6 gdn_in: 31.6 -> 20.4 us
    ('qkv', 5120, 2048, 1): GemvChoice(1, 64, norm_prologue=False),  # qwen3.6 qkv: 12.3 -> 10.3 us
    ('qkv', 5120, 2048, 2): GemvChoice(1, 64, norm_prologue=False),  # qwen3.6 qkv: 15.4 -> 12.0 us
    ('qkv', 4096, 2048, 1): GemvChoice(1, 32, norm_prologue=True),  # qwen3.6 gate: 9.3 -> 9.1 us
    ('qkv', 4096, 2048, 2): GemvChoice(1, 32, norm_prologue=False),  # qwen3.6 gate: 13.8 -> 10.5 us
    ('add', 2048, 4096, 1): GemvChoice(6, 64),  # qwen3.6 o: 7.9 -> 7.5 us
    ('add', 2048, 4096, 2): GemvChoice(1, 64),  # qwen3.6 o: 9.6 -> 9.3 us
}


def gemv_plan(projection: str, n: int, k: int, sms: int) -> tuple[GemvChoice, ...]:
    """The choice for each token count 0..MAX_TOKENS, the rules filled in (no zero, no None)."""
    plan = []
    for tokens in range(MAX_TOKENS + 1):
        c = TUNED.get((projection, n, k, tokens), GemvChoice())
        group = min(c.group or gemv_group(n, k, sms), GEMV_VARIANTS[c.variant].threads)
        prologue = (tokens <= NORM_IN_PROLOGUE_TOKENS if c.norm_prologue is None
                    else c.norm_prologue)
        plan.append(GemvChoice(c.variant, group, prologue))
    return tuple(plan)


def _matrix(weight):
    """The one matrix of a fused entry: the loader stores "qkv" and "gate_up" as a list of row
    parts, one matrix when they concatenate (weights.py's _fuse_rows); else None."""
    if isinstance(weight, list):
        return weight[0] if len(weight) == 1 else None
    return weight


def _rows(weight) -> int:
    """Output rows of a fused entry, whether one matrix or row parts."""
    return sum(p.shape[0] for p in (weight if isinstance(weight, list) else [weight]))


def _plain(weight) -> bool:
    """A float weight the GEMV reads: one contiguous, 16-byte aligned torch tensor, K % 8 == 0."""
    weight = _matrix(weight)
    return (hasattr(weight, "is_contiguous") and weight.is_contiguous()
            and weight.dim() == 2 and weight.shape[1] % 8 == 0 and weight.data_ptr() % 16 == 0)


def _gguf_parts(weight) -> list[QuantWeight] | None:
    """The GGUF row parts of a projection (one, or a qkv split by block type) when gguf_gemv_q8
    reads every one at every step the fused layer takes (v3 selected, blocks in torch tensors,
    parts of whole 8-row groups so that each part's output and bias slices stay aligned)."""
    from freetoken import env

    parts = weight if isinstance(weight, list) else [weight]
    if env.read().quant_gemv != "v3" or not all(
            isinstance(p, QuantWeight) and hasattr(p.data, "data_ptr")
            and quant_gemv.q8_reads(p.qtype, p.shape[1], QUANT_MIN_TOKENS) for p in parts):
        return None
    if len(parts) > 1 and any(p.shape[0] % 8 for p in parts):
        return None
    return parts


def _fp8(weight) -> ScaledWeight | None:
    """The FP8 matrix of a projection when fp8_gemv_fused reads it (v3 selected, one matrix in
    a torch tensor, scale blocks fp8_gemv takes)."""
    from freetoken import env

    weight = _matrix(weight)
    if (env.read().quant_gemv == "v3" and isinstance(weight, ScaledWeight)
            and weight.format == FP8 and len(weight.shape) == 2
            and hasattr(weight.data, "data_ptr")
            and quant_gemv.fp8_reads(0, weight.block, weight.shape[1])):
        return weight
    return None


def supported(cfg: ModelConfig, layers: list[LayerWeights], dtype: str, device) -> bool:
    """The rule, decided once at load: GPU, bf16/f16 activations, per-head or no q/k norm, and
    every projection weight a plain tensor the GEMV can read or, under v3, an FP8 matrix
    fp8_gemv_fused reads or (bf16 activations) GGUF blocks gguf_gemv_q8 reads (row parts only
    for qkv); other layouts keep the unfused path. Per step, steps of up to MAX_TOKENS tokens take it: there a GEMV that
    streams each weight once in 16-byte loads is bandwidth-bound, while cuBLAS pads M to its
    smallest tile and cannot fuse the epilogues."""
    from freetoken import env

    if device.is_cpu or dtype not in ("bfloat16", "float16") or not env.read().fused_decode:
        return False
    if cfg.qk_norm not in (None, "head"):
        return False
    # what the fused layer does not model: Gemma's GELU, block-output norms and scaled embedding
    if cfg.activation != "silu" or cfg.block_out_norms or cfg.embed_scale != 1.0:
        return False
    widths = (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.q_size)
    if cfg.linear is not None:
        widths += (cfg.linear.projection_size, cfg.linear.value_dim)
    if any(w % 8 for w in widths):
        return False
    for i, lw in enumerate(layers):
        if cfg.is_linear(i):
            names: tuple[str, ...] = ("gdn.in", "gdn.out")
        else:
            names = ("qkv", "o") + (("o_gate",) if cfg.attn_output_gate else ())
        dense = ("gate_up", "down") if not cfg.is_sparse(i) else ()
        def readable(name: str) -> bool:
            if _plain(lw[name]) or _fp8(lw[name]) is not None:
                return True
            parts = _gguf_parts(lw[name]) if dtype == "bfloat16" else None
            return parts is not None and (len(parts) == 1 or name in ("qkv", "gdn.in"))

        if not all(readable(n) for n in names + dense):
            return False
        bias = lw.get("qkv_bias")
        if bias is not None and not (hasattr(bias, "data_ptr") and bias.is_contiguous()
                                     and bias.data_ptr() % 16 == 0):
            return False
        if dense and cfg.intermediate_size % 8:
            return False
    return True


class FloatProjection:
    """A float weight through decode_gemv (kind "qkv": store, + bias), decode_gemv_add ("add":
    residual +=) or decode_gemv_swiglu ("swiglu"), with the plan's choice per token count."""

    _KERNELS = {"qkv": "decode_gemv", "add": "decode_gemv_add", "swiglu": "decode_gemv_swiglu"}
    max_tokens = MAX_TOKENS

    def __init__(self, weight, kind: str, n: int, k: int, sms: int, device):
        self.weight, self.kind = weight, kind
        self.plan = gemv_plan(kind, n, k, sms)
        self._fn = ops.bind(self._KERNELS[kind], device)

    def __call__(self, out: Array, x: Array, tokens: int, norm: Array | None = None,
                 eps: float = 0.0, bias: Array | None = None) -> None:
        c = self.plan[tokens]
        if self.kind == "qkv":
            self._fn(out, x, self.weight, bias, norm, eps, c.group, c.variant)
        elif self.kind == "add":
            self._fn(out, x, self.weight, c.group, c.variant)
        else:
            self._fn(out, x, self.weight, norm, eps, c.group, c.variant)


class QuantProjection:
    """GGUF row parts through gguf_gemv_q8 in the mode of its kind, each part into its own
    columns of the output (and bias); the norm always rides in the prologue (each block
    normalises x while it quantizes it)."""

    _MODES = {"qkv": quant_gemv.Q8_STORE, "add": quant_gemv.Q8_ADD,
              "swiglu": quant_gemv.Q8_SWIGLU}

    def __init__(self, parts: list[QuantWeight], kind: str, device):
        self.mode = self._MODES[kind]
        starts = [0]
        for p in parts:
            starts.append(starts[-1] + p.shape[0])
        self.parts = [(p.data, p.qtype, a, b) for p, a, b in zip(parts, starts, starts[1:])]
        self.max_tokens = min(quant_gemv.q8_max_tokens(p.qtype, p.shape[1]) for p in parts)
        self.plan = (GemvChoice(norm_prologue=True),) * (self.max_tokens + 1)
        self._fn = ops.bind("gguf_gemv_q8", device)

    def __call__(self, out: Array, x: Array, tokens: int, norm: Array | None = None,
                 eps: float = 0.0, bias: Array | None = None) -> None:
        if len(self.parts) == 1:
            data, qtype, _, _ = self.parts[0]
            self._fn(out, x, data, qtype, bias, norm, eps, self.mode, 0, Q8_PDL)
            return
        for data, qtype, a, b in self.parts:
            self._fn(out[:, a:b], x, data, qtype, None if bias is None else bias[a:b], norm, eps,
                     self.mode, 0, Q8_PDL)


class Fp8Projection:
    """An FP8 matrix through fp8_gemv_fused in the mode of its kind; the norm rides in the
    prologue up to NORM_IN_PROLOGUE_TOKENS tokens, as the float GEMV's rule."""

    max_tokens = MAX_TOKENS
    plan = tuple(GemvChoice(norm_prologue=t <= NORM_IN_PROLOGUE_TOKENS)
                 for t in range(MAX_TOKENS + 1))

    def __init__(self, weight: ScaledWeight, kind: str, device):
        from freetoken.models.forward.scaled_linear import kernel_operands

        self.mode = QuantProjection._MODES[kind]
        self.data, self.scales, self.row_scale, self.block = kernel_operands(weight)
        self._fn = ops.bind("fp8_gemv_fused", device)

    def __call__(self, out: Array, x: Array, tokens: int, norm: Array | None = None,
                 eps: float = 0.0, bias: Array | None = None) -> None:
        self._fn(out, x, self.data, self.scales, self.row_scale, *self.block, bias, norm, eps,
                 self.mode, quant_gemv.fp8_rows(tokens), Q8_PDL)


def projection(weight, kind: str, n: int, k: int, sms: int, device):
    """The fused step's projection for one weight (supported() has accepted it)."""
    parts = _gguf_parts(weight)
    if parts is not None:
        return QuantProjection(parts, kind, device)
    fp8 = _fp8(weight)
    if fp8 is not None:
        return Fp8Projection(fp8, kind, device)
    return FloatProjection(_matrix(weight), kind, n, k, sms, device)


class FusedLayer:
    """One decoder layer's decode step over the residual stream (see the module doc)."""

    def __init__(self, layer: DecoderLayer, w: LayerWeights, cfg: ModelConfig, index: int,
                 rope: Array, kernels: Kernels, sms: int, device):
        self.attn, self.mlp, self.ops = layer.attn, layer.mlp, kernels
        self.rope_store_kv = ops.bind("rope_store_kv", device)
        self._fp8_store, self._device = None, device   # the FP8 pool's, bound on first use
        self.input_norm, self.post_norm = w["input_norm"], w["post_norm"]
        self.rope, self.eps = rope, cfg.rms_norm_eps
        h = cfg.hidden_size

        def proj(name: str, kind: str, n: int, k: int):
            return projection(w[name], kind, n, k, sms, device)

        self.linear = cfg.is_linear(index)
        self.o_gate = None
        if self.linear:             # Gated DeltaNet: in projection, mix, out projection
            gdn_out = w["gdn.out"]
            self.gdn_in = proj("gdn.in", "qkv", _rows(w["gdn.in"]), h)
            self.gdn_out = proj("gdn.out", "add", h, gdn_out.shape[1])
            projections = [self.gdn_in, self.gdn_out]
        else:
            self.bias = w.get("qkv_bias")
            self.qkv = proj("qkv", "qkv", _rows(w["qkv"]), h)
            self.q_norm = w["q_norm"] if cfg.qk_norm == "head" else None
            self.k_norm = w["k_norm"] if cfg.qk_norm == "head" else None
            self.o = proj("o", "add", h, cfg.q_size)
            projections = [self.qkv, self.o]
            if w.get("o_gate") is not None:   # gated attention (hybrid models)
                self.o_gate = proj("o_gate", "qkv", cfg.q_size, h)
                projections.append(self.o_gate)
        self.dense = not cfg.is_sparse(index)
        if self.dense:
            inter = w["down"].shape[1]
            self.gate_up = proj("gate_up", "swiglu", inter, h)
            self.down = proj("down", "add", h, inter)
            projections += [self.gate_up, self.down]
        self.max_tokens = min(p.max_tokens for p in projections)

    def _rope_store_kv_fp8(self):
        if self._fp8_store is None:
            self._fp8_store = ops.bind("rope_store_kv_fp8", self._device)
        return self._fp8_store

    def forward(self, w: WorkViews, batch: ForwardBatch, k_cache: Array, v_cache: Array,
                block_size: int) -> None:
        """w.residual holds this layer's input; on return, its output (neither normed).
        A GDN layer's two caches are its conv and recurrent states."""
        if self.linear:
            self._deltanet(w, batch, k_cache, v_cache)
        else:
            self._attention(w, batch, k_cache, v_cache, block_size)
        self._mlp(w, batch)

    def _deltanet(self, w: WorkViews, batch: ForwardBatch, conv_state: Array,
                  ssm_state: Array) -> None:
        t = batch.num_tokens
        x, norm = self._normed_input(w, self.gdn_in.plan[t], self.input_norm)
        self.gdn_in(w.gdn_in, x, t, norm, self.eps)
        self.attn.mix(w, batch, conv_state, ssm_state)
        self.gdn_out(w.residual, w.gdn_core, t)

    def _attention(self, w: WorkViews, batch: ForwardBatch, k_cache: Array, v_cache: Array,
                   block_size: int) -> None:
        a, eps, t = self.attn, self.eps, batch.num_tokens
        x, norm = self._normed_input(w, self.qkv.plan[t], self.input_norm)
        self.qkv(w.qkv, x, t, norm, eps, self.bias)
        if self.o_gate is not None:   # the same normed input (or prologue) as qkv's
            self.o_gate(w.attn_gate, x, t, norm, eps)
        q, k, v = w.qkv_cols  # the projection's own columns: no q/k copies on this path
        if isinstance(k_cache, Fp8Pool):
            self._rope_store_kv_fp8()(batch.positions, q, k, v, self.rope, k_cache.codes,
                                      v_cache.codes, k_cache.scales, v_cache.scales,
                                      batch.slot_mapping, self.q_norm, self.k_norm, eps,
                                      a.head_dim, a.is_neox)
        else:
            self.rope_store_kv(batch.positions, q, k, v, self.rope, k_cache, v_cache,
                               batch.slot_mapping, self.q_norm, self.k_norm, eps, a.head_dim,
                               a.is_neox)
        self.ops.paged_attention(w.attn3, w.q3_cols, k_cache, v_cache, batch.block_tables,
                                 batch.seq_lens, batch.query_start_loc, block_size, a.scale,
                                 a.window, *self.ops.attn_extra)
        if self.o_gate is not None:
            mul_sigmoid(array_view(w.attn), array_view(w.attn_gate))
        self.o(w.residual, w.attn, t)

    def _mlp(self, w: WorkViews, batch: ForwardBatch) -> None:
        eps, t = self.eps, batch.num_tokens
        if self.dense:
            x, norm = self._normed_input(w, self.gate_up.plan[t], self.post_norm)
            self.gate_up(w.act, x, t, norm, eps)
            self.down(w.residual, w.act, t)
            return
        self.ops.rms_norm(w.hidden, w.residual, self.post_norm, eps)
        if self.mlp.decode_applies(t):   # moe_decode.py: adds into the residual
            self.mlp.decode(w.residual, w.hidden, w, accumulate=True)
            return
        y = self.mlp(w.hidden, w)
        w.residual.add_(y)  # rounded once to the dtype, as the unfused fused_add_rms_norm

    def _normed_input(self, w: WorkViews, choice: GemvChoice,
                      weight: Array) -> tuple[Array, Array]:
        """(x, the norm weight for the GEMV's prologue or None): the norm runs in the prologue
        where the choice says so, else as rms_norm into w.hidden."""
        if choice.norm_prologue:
            return w.residual, weight
        self.ops.rms_norm(w.hidden, w.residual, weight, self.eps)
        return w.hidden, None
