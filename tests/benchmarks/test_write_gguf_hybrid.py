"""benchmarks/write_gguf_hybrid.py: llama-quantize's Q4_K_M type choice for qwen35moe, the full
Qwen3.6-35B-A3B table's size, and a tiny file that gguf reads back and FreeToken runs."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kquant_random as kq
from benchmarks import write_gguf_hybrid as w

# use_more_bits(i, 40) listed by hand: the first and last five, and every third from 7 on
MORE_BITS_40 = set(range(5)) | set(range(35, 40)) | set(range(7, 35, 3))
FULL_40 = {3, 7, 11, 15, 19, 23, 27, 31, 35, 39}


def _types(shape) -> dict[str, int]:
    return {name: qtype for name, _, qtype in w.typed_table(shape)}


def test_full_shape_types_follow_llama_quantize_and_the_size_is_a_35b_a3b_q4_k_m():
    shape = w.QWEN36_35B_A3B
    types = _types(shape)
    assert types["output.weight"] == kq.Q6_K and types["token_embd.weight"] == kq.Q4_K
    assert types["output_norm.weight"] == kq.F32
    for i in range(40):
        more = kq.Q6_K if i in MORE_BITS_40 else kq.Q4_K
        for part in ("ffn_down_exps", "ffn_down_shexp"):
            assert types[f"blk.{i}.{part}.weight"] == more, (i, part)
        for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_shexp", "ffn_up_shexp"):
            assert types[f"blk.{i}.{part}.weight"] == kq.Q4_K, (i, part)
        f32 = ["attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight",
               "ffn_gate_inp_shexp.weight"]
        if i in FULL_40:
            assert types[f"blk.{i}.attn_v.weight"] == more, i
            for part in ("attn_q", "attn_k", "attn_output"):
                assert types[f"blk.{i}.{part}.weight"] == kq.Q4_K, (i, part)
            f32 += ["attn_q_norm.weight", "attn_k_norm.weight"]
            assert f"blk.{i}.attn_qkv.weight" not in types
        else:
            assert types[f"blk.{i}.attn_qkv.weight"] == more, i
            for part in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_out"):
                assert types[f"blk.{i}.{part}.weight"] == kq.Q4_K, (i, part)
            f32 += ["ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight"]
            assert f"blk.{i}.attn_v.weight" not in types
        for part in f32:
            assert types[f"blk.{i}.{part}"] == kq.F32, (i, part)
    assert len(MORE_BITS_40) == 20
    total = w.table_bytes(shape)
    print(f"Qwen3.6-35B-A3B Q4_K_M tensor data: {total} bytes = {total / 2**30:.2f} GiB")
    assert 19 * 2**30 < total < 22 * 2**30


def test_the_rule_on_small_and_one_dimensional_tensors():
    # [n, 1] has one ggml dim: kept float however its name reads
    assert w.q4_k_m_type("blk.0.ffn_gate_inp_shexp.weight", (2048, 1), 40, 256) == kq.F32
    assert w.q4_k_m_type("blk.0.ssm_conv1d.weight", (4, 8192), 40, 256) == kq.F32
    assert w.q4_k_m_type("blk.0.ssm_norm.weight", (128,), 40, 256) == kq.F32
    assert w.q4_k_m_type("blk.0.ssm_a", (32,), 40, 256) == kq.F32
    assert w.q4_k_m_type("blk.0.ssm_dt.bias", (32,), 40, 256) == kq.F32
    # rows of 128: fallbacks
    assert w.q4_k_m_type("blk.5.ffn_down_shexp.weight", (128, 256), 40, 256) == kq.Q5_0
    assert w.q4_k_m_type("blk.0.ffn_down_shexp.weight", (128, 256), 40, 256) == kq.Q8_0


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid") / "tiny-q4km.gguf"
    counts = w.write_q4_k_m(path, w.TINY, seed=0, threads=2, progress=None)
    return path, counts


def test_the_reader_reads_back_the_rule_and_the_metadata(tiny_file):
    from gguf import GGUFReader

    path, counts = tiny_file
    reader = GGUFReader(str(path))
    table = w.tensor_table(w.TINY)
    expected = _types(w.TINY)
    assert [t.name for t in reader.tensors] == [name for name, _ in table]
    for t, (_, ne) in zip(reader.tensors, table):
        assert int(t.tensor_type) == expected[t.name], t.name
        assert tuple(int(n) for n in t.shape) == ne, t.name
    # every type of the mix shows up, the fallbacks included
    assert {kq.NAMES[q] for q in expected.values()} == {"F32", "Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert counts["bytes"] == path.stat().st_size
    meta = {f.name: f for f in reader.fields.values()}

    def scalar(key):
        field = meta[key]
        return field.parts[field.data[0]].tolist()[0]

    assert bytes(meta["general.architecture"].parts[-1]).decode() == "qwen35moe"
    assert scalar("qwen35moe.block_count") == 4 and scalar("qwen35moe.expert_count") == 16
    assert scalar("general.file_type") == 15
    assert scalar("qwen35moe.full_attention_interval") == 4
    assert scalar("qwen35moe.ssm.time_step_rank") == 4 and scalar("qwen35moe.ssm.group_count") == 2
    recurrent = meta["qwen35moe.attention.recurrent_layers"]
    assert [bool(recurrent.parts[i][0]) for i in recurrent.data] == [True, True, True, False]
    assert len(meta["tokenizer.ggml.tokens"].data) == w.TINY.vocab


def test_freetoken_loads_the_file_and_gives_finite_logits(tiny_file, reference_moe_ops):
    from freetoken.models.loader import load_model
    from tests.models.helpers import PagedRunner

    loaded = load_model(str(tiny_file[0]), device="cpu")
    cfg = loaded.config
    assert cfg.architecture == "qwen3_5_moe" and cfg.num_layers == 4 and cfg.vocab_size == 512
    assert cfg.linear_layers == (True, True, True, False)
    assert cfg.linear.num_k_heads == 2 and cfg.linear.num_v_heads == 4
    assert cfg.moe.num_experts == 16 and cfg.moe.top_k == 2
    assert cfg.moe.intermediate_size == 128 and cfg.moe.shared_intermediate_size == 128
    runner = PagedRunner(loaded.model)
    prefill = runner.step([(0, [3, 17, 200, 45, 9, 301])])
    step = runner.step([(0, [77])])
    for logits in (prefill, step):
        assert logits.shape[-1] == 512 and torch.isfinite(logits).all()
        assert 0 < logits.float().std() < 10
