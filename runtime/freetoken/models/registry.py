"""The supported architectures, declared: the single source of truth for every family.

An architecture is found by its registry name, by an HF ``architectures`` class name, or by a
GGUF ``general.architecture`` string. Its ``ArchSpec`` says what its blocks are (attention
kind, dense or MoE MLP, routing rule) and how each checkpoint format names its weights; the
config readers (checkpoint/hf_config.py, checkpoint/gguf_config.py), the tensor readers and the
forward pass are driven by these tables, so a new family is an entry here plus what is new.

Canonical weight names: ``embed``, ``final_norm``, ``lm_head``, ``rope_freqs`` and, per layer
``layers.{i}.`` + one of ``LAYER_PARTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from freetoken.models.errors import UnsupportedModelError

# config.json spells the expert count either way (transformers 5 writes num_local_experts)
HF_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts")
ATTENTION_PARTS = ("input_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm",
                   "k_norm", "o", "post_norm", "attn_out_norm", "mlp_out_norm")
# post_norm is the norm in front of the MLP; gemma3 also norms each block's output
# (attn_out_norm, mlp_out_norm) before it joins the residual.
DENSE_MLP_PARTS = ("gate", "up", "down")
# experts.* are stacked [E, rows, cols] per layer, whatever the checkpoint's layout.
MOE_PARTS = ("router", "experts.gate", "experts.up", "experts.down", "shared.gate",
             "shared.up", "shared.down", "shared_gate")
# Gated DeltaNet (linear attention) layers: qwen3_next fuses the projections per key head
# (gdn.qkvz, gdn.ba), qwen3_5 keeps them apart (gdn.qkv, gdn.z, gdn.b, gdn.a).
GDN_PARTS = ("gdn.qkvz", "gdn.ba", "gdn.qkv", "gdn.z", "gdn.b", "gdn.a", "gdn.conv",
             "gdn.dt_bias", "gdn.A_log", "gdn.norm", "gdn.out")
LAYER_PARTS = ATTENTION_PARTS + DENSE_MLP_PARTS + MOE_PARTS + GDN_PARTS

HF_GLOBAL = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
             "lm_head": "lm_head.weight"}
HF_LAYER = {  # under model.layers.{i}.; "{moe}" is the sparse block's module name
    "input_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
    # gemma3 only (which calls the norm in front of its MLP pre_feedforward_layernorm)
    "attn_out_norm": "post_attention_layernorm.weight",
    "mlp_out_norm": "post_feedforward_layernorm.weight",
    "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    "router": "{moe}.gate.weight",
    "shared.gate": "{moe}.shared_expert.gate_proj.weight",
    "shared.up": "{moe}.shared_expert.up_proj.weight",
    "shared.down": "{moe}.shared_expert.down_proj.weight",
    "shared_gate": "{moe}.shared_expert_gate.weight",
    "gdn.qkvz": "linear_attn.in_proj_qkvz.weight", "gdn.ba": "linear_attn.in_proj_ba.weight",
    "gdn.qkv": "linear_attn.in_proj_qkv.weight", "gdn.z": "linear_attn.in_proj_z.weight",
    "gdn.b": "linear_attn.in_proj_b.weight", "gdn.a": "linear_attn.in_proj_a.weight",
    "gdn.conv": "linear_attn.conv1d.weight", "gdn.dt_bias": "linear_attn.dt_bias",
    "gdn.A_log": "linear_attn.A_log", "gdn.norm": "linear_attn.norm.weight",
    "gdn.out": "linear_attn.out_proj.weight",
}
# Multimodal checkpoints keep the text model under this prefix instead of "model."
HF_TEXT_PREFIXES = ("model.language_model.",)
# The three ways HF checkpoints store routed experts, tried in this order.
HF_EXPERTS_FUSED = {"gate_up": "{moe}.experts.gate_up_proj", "down": "{moe}.experts.down_proj"}
HF_EXPERTS_STACKED = {"gate": "{moe}.experts.gate_proj", "up": "{moe}.experts.up_proj",
                      "down": "{moe}.experts.down_proj"}
HF_EXPERTS_PER_EXPERT = "{moe}.experts.{e}.{proj}.weight"

GGUF_GLOBAL = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
               "lm_head": "output.weight", "rope_freqs": "rope_freqs.weight"}
GGUF_LAYER = {  # under blk.{i}.
    "input_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight",
    "v": "attn_v.weight", "q_bias": "attn_q.bias", "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "o": "attn_output.weight", "post_norm": "ffn_norm.weight",
    "attn_out_norm": "post_attention_norm.weight", "mlp_out_norm": "post_ffw_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight", "down": "ffn_down.weight",
    "router": "ffn_gate_inp.weight", "experts.gate": "ffn_gate_exps.weight",
    "experts.up": "ffn_up_exps.weight", "experts.down": "ffn_down_exps.weight",
    "shared.gate": "ffn_gate_shexp.weight", "shared.up": "ffn_up_shexp.weight",
    "shared.down": "ffn_down_shexp.weight", "shared_gate": "ffn_gate_inp_shexp.weight",
    # Gated DeltaNet, as llama.cpp's converter writes it (checkpoint/gguf_hybrid.py undoes what
    # it changed): qwen3next files split in_proj_qkvz into attn_qkv (q, k, v of every head)
    # and attn_gate (z) and keep in_proj_ba; older ones kept in_proj_qkvz as ssm_in. ssm_a
    # holds -exp(A_log).
    "gdn.qkvz": "ssm_in.weight", "gdn.ba": "ssm_ba.weight", "gdn.qkv": "attn_qkv.weight",
    "gdn.z": "attn_gate.weight", "gdn.b": "ssm_beta.weight", "gdn.a": "ssm_alpha.weight",
    "gdn.conv": "ssm_conv1d.weight", "gdn.dt_bias": "ssm_dt.bias", "gdn.A_log": "ssm_a",
    "gdn.norm": "ssm_norm.weight", "gdn.out": "ssm_out.weight",
}


@dataclass(frozen=True)
class AttentionSpec:
    """Full causal attention with GQA and rope; what varies between families."""

    bias: bool = False               # q/k/v carry a bias (when config.json does not say)
    bias_key: str | None = "attention_bias"   # the config.json key that says (None: fixed)
    qk_norm: str | None = None       # "head": RMSNorm per head (qwen3); "full": whole q, k (olmoe)
    config_window: bool = False      # config.json's sliding_window applies to every layer
    # gemma3: sliding and global layers interleave (config.json's layer_types; GGUF files say
    # only the window, llama.cpp fixes the pattern: every n-th layer global) with two rope bases
    gguf_global_every: int = 0
    gguf_local_rope_theta: float | None = None   # llama.cpp's fixed base of the sliding layers


@dataclass(frozen=True)
class MoESpec:
    """A routed-expert MLP: softmax over the router logits, the top k experts (SwiGLU each),
    their outputs weighted by the probabilities (renormalised or not)."""

    hf_modules: tuple[str, ...] = ("mlp",)   # the sparse block's module name(s) in checkpoints
    hf_expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    hf_intermediate: str = "moe_intermediate_size"   # config.json's key for the expert width
    renormalize: bool | None = None          # None: config.json's norm_topk_prob (default False)
    gguf_renormalize: bool = False           # what llama.cpp does when the GGUF does not say
    shared_expert: bool = False              # an always-on expert times sigmoid(x @ gate)
    sparse_step: bool = False                # decoder_sparse_step / mlp_only_layers apply
    # fused experts may be stored [E, hidden, 2 * I] / [E, I, hidden] (Qwen3-VL-MoE's released
    # checkpoints): read transposed when the shapes say so, as transformers does
    hf_fused_transposed: bool = False


@dataclass(frozen=True)
class HybridSpec:
    """Gated DeltaNet layers between gated full-attention ones (Qwen3-Next, Qwen3.5/3.6).

    The layer pattern comes from config.json (layer_types, or full_attention_interval) or the
    GGUF metadata (attention.recurrent_layers, or full_attention_interval); full attention
    layers double q_proj into query + a sigmoid output gate; RMSNorms scale by (1 + w) except
    the GDN output norm (GGUF files store 1 + w)."""

    gdn_layout: str = "split"                # "qkvz": fused per key head (qwen3_next)
    partial_rotary_factor: float = 0.25      # when config.json does not say
    # llama.cpp calls the norm in front of the MLP post_attention_norm in these families
    gguf_layer_names: tuple[tuple[str, str], ...] = (
        ("post_norm", "post_attention_norm.weight"),)
    # llama.cpp's converter reorders the value heads from grouped by key head (HF: value head
    # j reads key head j // (Hv / Hk)) to tiled (head i * Hk + g reads key head g) when Hv > Hk
    gguf_tiled_value_heads: bool = False


@dataclass(frozen=True)
class GemmaSpec:
    """What Gemma does differently: RMSNorm scales by (1 + w) (HF stores w; llama.cpp's
    converter already added the 1), the embedding is scaled by sqrt(hidden), the MLP gate is
    GELU (tanh), each block's output is normed, and chat turns end with <end_of_turn>."""

    hf_layer_names: tuple[tuple[str, str], ...] = (
        ("post_norm", "pre_feedforward_layernorm.weight"),)
    hf_norm_offset: float = 1.0
    gguf_end_of_turn: str = "<end_of_turn>"


@dataclass(frozen=True)
class ArchSpec:
    """One architecture: its names, its blocks, and its checkpoint quirks."""

    name: str
    hf_classes: tuple[str, ...]
    gguf_names: tuple[str, ...]
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    moe: MoESpec | None = None               # None: a dense SwiGLU MLP in every layer
    gguf_permuted_qk: bool = False           # llama.cpp's converter interleaved the q/k rows
    hybrid: HybridSpec | None = None         # None: full attention in every layer
    gemma: GemmaSpec | None = None           # Gemma's conventions (None: none of them)
    # a vision-language config.json: the text model's keys nested under text_config
    text_config: bool = False


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.name: spec for spec in (
        ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), gguf_permuted_qk=True),
        ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",),
                 AttentionSpec(bias=True, bias_key=None)),
        ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), AttentionSpec(qk_norm="head")),
        ArchSpec("mistral", ("MistralForCausalLM",), (), AttentionSpec(config_window=True)),
        ArchSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",),
                 AttentionSpec(qk_norm="head"), MoESpec(sparse_step=True,
                                                        gguf_renormalize=True)),
        ArchSpec("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2moe",),
                 AttentionSpec(bias=True, bias_key="qkv_bias"),
                 MoESpec(sparse_step=True, shared_expert=True)),
        ArchSpec("mixtral", ("MixtralForCausalLM",), ("llama",),
                 AttentionSpec(config_window=True),
                 MoESpec(hf_modules=("mlp", "block_sparse_moe"),
                         hf_expert_projections=("w1", "w3", "w2"),
                         hf_intermediate="intermediate_size",
                         renormalize=True, gguf_renormalize=True),
                 gguf_permuted_qk=True),
        ArchSpec("olmoe", ("OlmoeForCausalLM",), ("olmoe",), AttentionSpec(qk_norm="full"),
                 MoESpec(hf_intermediate="intermediate_size")),
        # llama.cpp's graphs renormalize the top-k probabilities of both hybrids (no GGUF key)
        ArchSpec("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3next",),
                 AttentionSpec(qk_norm="head"),
                 MoESpec(sparse_step=True, shared_expert=True, gguf_renormalize=True),
                 hybrid=HybridSpec(gdn_layout="qkvz")),
        ArchSpec("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
                 ("qwen35moe",), AttentionSpec(qk_norm="head"),
                 MoESpec(shared_expert=True, renormalize=True, gguf_renormalize=True),
                 hybrid=HybridSpec(gguf_tiled_value_heads=True), text_config=True),
        # Qwen3-VL: the qwen3 text model behind the vision tower (its DeepStack features are
        # the tower's business: checkpoint/vision_config.py, forward/deepstack.py)
        ArchSpec("qwen3_vl", ("Qwen3VLForConditionalGeneration",), (),
                 AttentionSpec(qk_norm="head"), text_config=True),
        ArchSpec("qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration",), (),
                 AttentionSpec(qk_norm="head"),
                 MoESpec(sparse_step=True, renormalize=True, hf_fused_transposed=True),
                 text_config=True),
        ArchSpec("gemma3", ("Gemma3ForCausalLM",), ("gemma3",),
                 AttentionSpec(qk_norm="head", gguf_global_every=6,
                               gguf_local_rope_theta=10000.0),
                 gemma=GemmaSpec()),
    )
}


# config.json model_type spellings that differ from the registry name
_HF_MODEL_TYPES = {"gemma3_text": "gemma3"}


def supported_names() -> list[str]:
    """Every accepted spelling: registry names, HF classes and GGUF architecture strings."""
    names = set(ARCHITECTURES)
    for spec in ARCHITECTURES.values():
        names.update(spec.hf_classes)
        names.update(spec.gguf_names)
    return sorted(names)


def _unsupported(what: str, source: str) -> UnsupportedModelError:
    listed = ", ".join(sorted(ARCHITECTURES))
    classes = ", ".join(c for s in ARCHITECTURES.values() for c in s.hf_classes)
    gguf = ", ".join(sorted({n for s in ARCHITECTURES.values() for n in s.gguf_names}))
    return UnsupportedModelError(
        f"{source}: architecture {what!r} is not supported; supported: {listed} "
        f"(HF classes {classes}; GGUF {gguf}, mixtral as llama with experts)")


def spec_for_name(name: str, source: str = "model") -> ArchSpec:
    """The spec for a registry name (llama, qwen3_moe, ...)."""
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise _unsupported(name, source)
    return spec


def spec_for_hf(hf_config: dict[str, Any], source: str) -> ArchSpec:
    """The spec named by config.json's ``architectures`` (or ``model_type`` when absent)."""
    classes = hf_config.get("architectures") or []
    for cls in classes:
        for spec in ARCHITECTURES.values():
            if cls in spec.hf_classes:
                return spec
    model_type = _HF_MODEL_TYPES.get(hf_config.get("model_type"), hf_config.get("model_type"))
    if not classes and model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    raise _unsupported(", ".join(classes) or str(hf_config.get("model_type")), source)


def spec_for_gguf(arch: str, source: str, has_experts: bool = False) -> ArchSpec:
    """The spec for a GGUF ``general.architecture`` value; llama.cpp writes Mixtral as
    `llama` with ``llama.expert_count`` > 0, so `has_experts` picks between the two."""
    candidates = [s for s in ARCHITECTURES.values() if arch in s.gguf_names]
    for spec in candidates:
        if len(candidates) == 1 or (spec.moe is not None) == has_experts:
            return spec
    raise _unsupported(arch, source)
