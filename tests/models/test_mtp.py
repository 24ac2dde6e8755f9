"""The multi-token-prediction block of qwen3_next and qwen3_5_moe checkpoints (forward/mtp.py).

transformers drops mtp.* weights, so the tiny hybrid checkpoints of test_hybrid_hf get random
MTP tensors written beside theirs, shaped and named as the published checkpoints name them
(Qwen3.5: fused experts; Qwen3-Next: one module per expert). FreeToken's block, fed the target's
final-normed hidden states, must give the logits of a float64 reference written here from the
published architecture (vLLM's and SGLang's qwen3_next_mtp.py / qwen3_5_mtp.py):
z = fc([norm_e(embed(x_{t+1})) | norm_h(h_t)]), one gated full-attention layer with the
target's MoE at position t over the block's own K/V, mtp.norm, the target's LM head; the output
hidden state feeds the next draft step. Chunked prefill and recursive draft steps, two sequences.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from freetoken.arrays import array_view
from freetoken.models.batch import ForwardBatch
from freetoken.models.errors import MissingTensorError, ModelFormatError
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner
from tests.models.test_hybrid_hf import build_hybrid
from tests.tolerances import EPS, assert_close

ARCHS = ("qwen3_5_moe", "qwen3_next")


def mtp_tensors(cfg, layout: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Random mtp.* tensors for HF config `cfg`; norms stored as w (the model scales by 1 + w),
    experts "fused" ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) or "per_expert"."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return scale * torch.randn(*shape, generator=gen)

    h, d = cfg.hidden_size, cfg.head_dim
    hq, hk = cfg.num_attention_heads, cfg.num_key_value_heads
    e, inter, shared = cfg.num_experts, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    p = "mtp.layers.0."
    t = {"mtp.fc.weight": rand(h, 2 * h)}
    for name in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm",
                 p + "input_layernorm", p + "post_attention_layernorm"):
        t[name + ".weight"] = rand(h, scale=0.2)
    t.update({p + "self_attn.q_proj.weight": rand(2 * hq * d, h),
              p + "self_attn.k_proj.weight": rand(hk * d, h),
              p + "self_attn.v_proj.weight": rand(hk * d, h),
              p + "self_attn.o_proj.weight": rand(h, hq * d),
              p + "self_attn.q_norm.weight": rand(d, scale=0.2),
              p + "self_attn.k_norm.weight": rand(d, scale=0.2),
              p + "mlp.gate.weight": rand(e, h, scale=2.0),
              p + "mlp.shared_expert.gate_proj.weight": rand(shared, h),
              p + "mlp.shared_expert.up_proj.weight": rand(shared, h),
              p + "mlp.shared_expert.down_proj.weight": rand(h, shared),
              p + "mlp.shared_expert_gate.weight": rand(1, h)})
    gate_up, down = rand(e, 2 * inter, h), rand(e, h, inter)
    if layout == "fused":
        t[p + "mlp.experts.gate_up_proj"], t[p + "mlp.experts.down_proj"] = gate_up, down
    else:
        for x in range(e):
            t[p + f"mlp.experts.{x}.gate_proj.weight"] = gate_up[x, :inter].clone()
            t[p + f"mlp.experts.{x}.up_proj.weight"] = gate_up[x, inter:].clone()
            t[p + f"mlp.experts.{x}.down_proj.weight"] = down[x].clone()
    return t


def add_mtp(directory, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` into the folder's model.safetensors; config.json declares one layer."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    state.update({k: v.contiguous() for k, v in tensors.items()})
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """arch -> (directory, HF target model, the mtp.* tensors written)."""
    built = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"mtp-{arch}")
            hf = build_hybrid(arch, directory, seed=2)
            tensors = mtp_tensors(hf.config, "fused" if arch == "qwen3_5_moe" else "per_expert")
            add_mtp(directory, tensors)
            built[arch] = (directory, hf, tensors)
        return built[arch]

    return get


# -- the float64 reference ----------------------------------------------------------------------

def _norm(x, w, eps):
    """Qwen3-Next / Qwen3.5 RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, positions, rot, theta):
    """Rotate the first `rot` dims of each head [T, heads, D] in halves (neox layout)."""
    inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    angle = positions.double()[:, None] * inv[None]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x[..., :rot // 2], x[..., rot // 2:rot]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., rot:]], dim=-1)


def _experts(w: dict, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = "mtp.layers.0.mlp.experts."
    if p + "gate_up_proj" in w:
        return w[p + "gate_up_proj"], w[p + "down_proj"]
    gate_up = torch.stack([torch.cat([w[p + f"{x}.gate_proj.weight"],
                                      w[p + f"{x}.up_proj.weight"]]) for x in range(e)])
    return gate_up, torch.stack([w[p + f"{x}.down_proj.weight"] for x in range(e)])


def _moe(x, w, cfg, renormalize: bool):
    p = "mtp.layers.0.mlp."
    probs = (x @ w[p + "gate.weight"].T).softmax(-1)
    top, ids = probs.topk(cfg.num_experts_per_tok, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    gate_up, down = _experts(w, cfg.num_experts)
    inter = gate_up.shape[1] // 2
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for weight, expert in zip(top[row], ids[row]):
            g = gate_up[expert] @ x[row]
            out[row] += weight * (down[expert] @ (torch.nn.functional.silu(g[:inter]) * g[inter:]))
    s = "shared_expert."
    act = torch.nn.functional.silu(x @ w[p + s + "gate_proj.weight"].T) * \
        (x @ w[p + s + "up_proj.weight"].T)
    shared = act @ w[p + s + "down_proj.weight"].T
    return out + torch.sigmoid(x @ w[p + "shared_expert_gate.weight"].T) * shared


def mtp_reference(w: dict, hf, tokens, hidden, positions, renormalize: bool):
    """(logits [T, vocab], output hidden [T, H]) of one sequence's rows, float64: row i reads
    the rows 0..i (causal), as the block's paged K/V holds them."""
    cfg = hf.config
    w = {k: v.double() for k, v in w.items()}
    eps, d, hq, hk = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, \
        cfg.num_key_value_heads
    rot = int(d * cfg.rope_parameters.get("partial_rotary_factor", 0.25))
    theta = cfg.rope_parameters["rope_theta"]
    embed = hf.get_input_embeddings().weight.detach().double()[torch.as_tensor(tokens)]
    h = torch.as_tensor(np.asarray(hidden)).double()
    pos = torch.as_tensor(positions)
    z = torch.cat([_norm(embed, w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _norm(h, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
    p = "mtp.layers.0."
    x = _norm(z, w[p + "input_layernorm.weight"], eps)
    t = x.shape[0]
    q_gate = (x @ w[p + "self_attn.q_proj.weight"].T).view(t, hq, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(t, hq * d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(t, hk, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, hk, d)
    q = _rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps), pos, rot, theta)
    k = _rope(_norm(k, w[p + "self_attn.k_norm.weight"], eps), pos, rot, theta)
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * d ** -0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, hq * d)
    z = z + (attn * torch.sigmoid(gate)) @ w[p + "self_attn.o_proj.weight"].T
    z = z + _moe(_norm(z, w[p + "post_attention_layernorm.weight"], eps), w, cfg, renormalize)
    out = _norm(z, w["mtp.norm.weight"], eps)
    return out @ hf.lm_head.weight.detach().double().T, out


# -- driving the block over a paged pool ---------------------------------------------------------

class Pages:
    """Scattered pages per sequence, as the engine hands them out (one pool's addressing)."""

    def __init__(self, num_blocks: int = 16, block_size: int = 4, seed: int = 1,
                 arrays=None):
        self.block_size = block_size
        self.index = arrays.index if arrays is not None else (lambda values: values)
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)
                                   ).tolist()
        self.pages: dict[int, list[int]] = {}

    def batch(self, chunks: list[tuple[int, list[int], list[int]]]) -> ForwardBatch:
        """A step over (sequence, token ids, positions) chunks; logits of each chunk's end."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for seq, tokens, positions in chunks:
            pages = self.pages.setdefault(seq, [])
            for p in positions:
                while p // self.block_size >= len(pages):
                    pages.append(self.free.pop())
                slots.append(pages[p // self.block_size] * self.block_size + p % self.block_size)
            ids += tokens
            pos += positions
            starts.append(len(ids))
            lens.append(positions[-1] + 1)
        width = max(len(self.pages[s]) for s, _, _ in chunks)
        tables = [self.pages[s] + [0] * (width - len(self.pages[s])) for s, _, _ in chunks]
        on = self.index
        return ForwardBatch(
            input_ids=on(np.array(ids, np.int64)), positions=on(np.array(pos, np.int64)),
            slot_mapping=on(np.array(slots, np.int64)),
            block_tables=on(np.array(tables, np.int32)), seq_lens=on(np.array(lens, np.int32)),
            query_start_loc=on(np.array(starts, np.int32)),
            logits_indices=on(np.array(starts[1:], np.int64) - 1),
            max_query_len=max(len(t) for _, t, _ in chunks))


def assert_mtp_logits_close(ours, expected, cfg, msg: str = "") -> None:
    """float32 against float64: rounding grows with the products on the way (fc over 2H, q/k/v
    over H, o over the heads, the experts' and shared expert's widths, the LM head over H) and
    the attention's sum over the context."""
    width = 4 * cfg.hidden_size + cfg.q_size + cfg.moe.intermediate_size + \
        cfg.moe.shared_intermediate_size + 32
    assert_close(torch.as_tensor(np.asarray(ours)), expected, torch.float32, terms=width,
                 msg=msg)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_matches_reference(arch, mtp_checkpoint, moe_ops):
    directory, hf, tensors = mtp_checkpoint(arch)
    loaded = load_model(str(directory), device="cpu")
    model, cfg = loaded.model, loaded.config
    assert cfg.mtp_num_hidden_layers == 1
    mtp = model.mtp
    assert mtp is not None and mtp.num_layers == 1 and mtp.config.kv_layers == [0]
    # the target's step exposes its final-normed hidden states: the rows its LM head reads
    gen = torch.Generator().manual_seed(4)
    prompts = {0: torch.randint(3, cfg.vocab_size, (11,), generator=gen).tolist(),
               1: torch.randint(3, cfg.vocab_size, (7,), generator=gen).tolist()}
    logits = PagedRunner(model).step([(0, prompts[0]), (1, prompts[1])])
    hidden = np.array(array_view(model.last_hidden), copy=True)
    residual = np.array(array_view(model.last_residual), copy=True)
    ends = [len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1]
    head = hf.lm_head.weight.detach().double()
    assert_close(logits, torch.as_tensor(hidden[ends]).double() @ head.T, torch.float32,
                 terms=cfg.hidden_size)
    final = _norm(torch.as_tensor(residual).double(), hf.model.norm.weight.detach().double(),
                  cfg.rms_norm_eps)
    assert_close(hidden, final, torch.float32, terms=cfg.hidden_size)
    # each sequence's MTP rows: token x_{t+1}, hidden h_t, position t (x_n: the target's pick)
    rows = {0: slice(0, ends[0] + 1), 1: slice(ends[0] + 1, ends[1] + 1)}
    seqs = {s: {"tokens": prompts[s][1:] + [int(logits[s].argmax())],
                "hidden": list(hidden[rows[s]]), "positions": list(range(len(prompts[s])))}
            for s in (0, 1)}
    kv = mtp.create_kv_cache(16, 4)
    pages = Pages()

    def run(parts):   # parts: (seq, first row, end row) of each sequence's MTP rows
        chunks = [(s, seqs[s]["tokens"][a:b], seqs[s]["positions"][a:b]) for s, a, b in parts]
        h_in = np.concatenate([np.stack(seqs[s]["hidden"][a:b]) for s, a, b in parts])
        out_logits, out_hidden = mtp.forward(pages.batch(chunks), h_in, kv)
        renorm = cfg.moe.renormalize
        for row, (s, _, b) in enumerate(parts):
            q = seqs[s]
            ref_logits, ref_hidden = mtp_reference(tensors, hf, q["tokens"][:b], q["hidden"][:b],
                                                   q["positions"][:b], renorm)
            where = f"{arch} seq {s} row {b - 1}"
            assert_mtp_logits_close(out_logits[row], ref_logits[b - 1], cfg, where)
            assert_close(np.asarray(out_hidden)[row], ref_hidden[b - 1], torch.float32,
                         terms=4 * cfg.hidden_size, msg=where)
        return np.asarray(out_logits), np.array(out_hidden, copy=True)

    # prefill in chunks: each second chunk attends to K/V the first call wrote
    run([(0, 0, 5), (1, 0, 6)])
    out_logits, out_hidden = run([(0, 5, 11), (1, 6, 7)])
    draft_logits, draft_hidden = dict(enumerate(out_logits)), dict(enumerate(out_hidden))
    # recursive drafts: the block's own output hidden state and its greedy token, one position on
    for _ in range(2):
        for s in (0, 1):
            q = seqs[s]
            q["tokens"].append(int(np.argmax(draft_logits[s])))
            q["hidden"].append(draft_hidden[s])
            q["positions"].append(q["positions"][-1] + 1)
        n0, n1 = len(seqs[0]["tokens"]), len(seqs[1]["tokens"])
        out_logits, out_hidden = run([(0, n0 - 1, n0), (1, n1 - 1, n1)])
        draft_logits, draft_hidden = dict(enumerate(out_logits)), dict(enumerate(out_hidden))


def test_no_mtp_tensors_no_block(tmp_path):
    build_hybrid("qwen3_5_moe", tmp_path, seed=1)
    loaded = load_model(str(tmp_path))
    assert loaded.model.mtp is None
    assert loaded.config.mtp_num_hidden_layers == 0


def test_malformed_mtp_tensor_is_named(tmp_path):
    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=1)
    tensors = mtp_tensors(hf.config, "fused")
    h = hf.config.hidden_size
    tensors["mtp.fc.weight"] = torch.zeros(h, h)     # [H, H]: the hidden half is missing
    add_mtp(tmp_path, tensors)
    with pytest.raises(ModelFormatError, match=r"mtp\.fc\.weight.*\[64, 64\].*\[64, 128\]"):
        load_model(str(tmp_path))


def test_missing_mtp_tensor_is_named(tmp_path):
    hf = build_hybrid("qwen3_5_moe", tmp_path, seed=1)
    tensors = mtp_tensors(hf.config, "fused")
    del tensors["mtp.layers.0.self_attn.k_proj.weight"]
    add_mtp(tmp_path, tensors)
    with pytest.raises(MissingTensorError, match=r"mtp\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(str(tmp_path))


def test_memory_plan_counts_the_mtp_block(mtp_checkpoint, tmp_path):
    """The weight bytes the memory plan reads grow by the MTP block's placed bytes."""
    from freetoken.arrays import HostArrays
    from freetoken.models.checkpoint.footprint import weight_bytes
    from freetoken.models.checkpoint.hf import read_hf_dir
    from freetoken.models.checkpoint.weights import Placement

    directory, hf, tensors = mtp_checkpoint("qwen3_5_moe")
    build_hybrid("qwen3_5_moe", tmp_path, seed=2)
    where = Placement(HostArrays(), "float32")

    def placed(folder):
        config, tensors, _, _ = read_hf_dir(folder)
        return weight_bytes(tensors, config, where)

    with_mtp, without = placed(directory), placed(tmp_path)
    assert with_mtp.other - without.other == 4 * sum(t.numel() for t in tensors.values())
    assert with_mtp.experts == without.experts


def write_mtp_gguf(hf, tensors: dict[str, torch.Tensor], tokenizer_dir, path) -> None:
    """qwen35moe GGUF (float32) with the MTP block as llama.cpp's converter writes it
    (_Qwen35MtpMixin): block_count counts it, {arch}.nextn_predict_layers, mtp.layers.0.* as
    block L = num_hidden_layers, fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm as
    blk.L.nextn.eh_proj / enorm / hnorm / shared_head_norm; every norm holds 1 + w."""
    import copy

    from gguf import GGUFWriter

    from tests.models.hybrid_gguf import GGUF_ARCH, _metadata, converter_tensors, gguf_name
    from tests.models.tiny_gguf import _split_experts, _tokenizer_metadata

    layers = hf.config.num_hidden_layers
    shown = copy.copy(hf.config)
    shown.num_hidden_layers = layers + 1
    writer = GGUFWriter(str(path), GGUF_ARCH["qwen3_5_moe"])
    _metadata(writer, shown, "qwen3_5_moe")
    writer.add_nextn_predict_layers(1)
    _tokenizer_metadata(writer, tokenizer_dir)
    for name, w in converter_tensors(hf, "qwen3_5_moe").items():
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(w.numpy()))
    nextn = {"mtp.fc.weight": "eh_proj", "mtp.pre_fc_norm_embedding.weight": "enorm",
             "mtp.pre_fc_norm_hidden.weight": "hnorm", "mtp.norm.weight": "shared_head_norm"}
    for name, w in _split_experts(tensors).items():
        # the converter renames first (pre_fc_norm_hidden -> hnorm.weight, ...), then adds 1 to
        # every *norm.weight: the two pre-fc norms included
        w = w.float() + 1 if "norm" in name else w.float()
        target = (f"blk.{layers}.nextn.{nextn[name]}.weight" if name in nextn else
                  gguf_name(name.replace("mtp.layers.0.", f"model.layers.{layers}.", 1)))
        writer.add_tensor(target, np.ascontiguousarray(w.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_mtp_matches_reference(mtp_checkpoint, moe_ops, tmp_path):
    directory, hf, tensors = mtp_checkpoint("qwen3_5_moe")
    path = tmp_path / "tiny-mtp.gguf"
    write_mtp_gguf(hf, tensors, directory, path)
    loaded = load_model(str(path), device="cpu")
    cfg = loaded.config
    assert cfg.num_layers == hf.config.num_hidden_layers and cfg.mtp_num_hidden_layers == 1
    mtp = loaded.model.mtp
    assert mtp is not None
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(3, cfg.vocab_size, (9,), generator=gen).tolist()
    hidden = torch.randn(9, cfg.hidden_size, generator=gen).numpy()
    positions = list(range(9))
    logits, out = mtp.forward(Pages().batch([(0, tokens, positions)]), hidden,
                              mtp.create_kv_cache(16, 4))
    ref_logits, ref_hidden = mtp_reference(tensors, hf, tokens, hidden, positions,
                                           cfg.moe.renormalize)
    assert_mtp_logits_close(logits[0], ref_logits[-1], cfg, "gguf")
    assert_close(np.asarray(out)[0], ref_hidden[-1], torch.float32, terms=4 * cfg.hidden_size)


def test_gguf_without_mtp_block(mtp_checkpoint, tmp_path):
    """A file without nextn tensors (the converter's --no-mtp) loads without the block."""
    from tests.models.hybrid_gguf import write_hybrid_gguf

    directory, hf, _ = mtp_checkpoint("qwen3_5_moe")
    write_hybrid_gguf(hf, directory, tmp_path / "plain.gguf", "qwen3_5_moe")
    loaded = load_model(str(tmp_path / "plain.gguf"))
    assert loaded.model.mtp is None and loaded.config.mtp_num_hidden_layers == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_mtp_matches_reference(arch, tmp_path, moe_ops):
    """bf16 on the GPU against the float64 reference: logits within a few bf16 roundings of the
    handful of products on the way (relative to their norm)."""
    # the GPU kernels take head dims of 64, 128 or 256 (the CPU tests' shape has 16)
    directory = tmp_path
    hf = build_hybrid(arch, directory, seed=2, head_dim=64, linear_key_head_dim=64,
                      linear_value_head_dim=64)
    tensors = mtp_tensors(hf.config, "fused" if arch == "qwen3_5_moe" else "per_expert")
    add_mtp(directory, tensors)
    loaded = load_model(str(directory), device="cuda")
    mtp, cfg = loaded.model.mtp, loaded.config
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, cfg.vocab_size, (12,), generator=gen).tolist()
    hidden = torch.randn(12, cfg.hidden_size, generator=gen)
    positions = list(range(12))
    batch = Pages(block_size=16, arrays=loaded.model.arrays).batch([(0, tokens, positions)])
    logits, _ = mtp.forward(batch, hidden.to("cuda", torch.bfloat16),
                            mtp.create_kv_cache(16, 16))
    ref, _ = mtp_reference(tensors, hf, tokens, hidden.bfloat16().double(), positions,
                           cfg.moe.renormalize)
    ours = torch.as_tensor(logits).double().cpu()[0]
    assert ((ours - ref[-1]).norm() / ref[-1].norm()).item() < 16 * EPS["bfloat16"]
