"""benchmarks/write_gguf_moe.py: llama-quantize's Q4_K_M type choice, realistic random blocks,
and a tiny file written by the same function that gguf reads back and FreeToken runs."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from benchmarks import kquant_random as kq
from benchmarks import write_gguf_moe as w

# llama-quantize's "more bits" layers of a 48-layer model, listed by hand: the first and last
# six, and every third layer from 8 on
MORE_BITS_48 = set(range(6)) | set(range(42, 48)) | set(range(8, 42, 3))


def _types(shape) -> dict[str, int]:
    return {name: w.q4_k_m_type(name, ne, shape.layers, shape.experts)
            for name, ne in w.tensor_table(shape)}


def test_full_depth_types_follow_llama_quantize():
    types = _types(w.QWEN3_30B_A3B)
    assert types["output.weight"] == kq.Q6_K and types["token_embd.weight"] == kq.Q4_K
    assert types["output_norm.weight"] == kq.F32
    for i in range(48):
        more = i in MORE_BITS_48
        assert types[f"blk.{i}.attn_v.weight"] == (kq.Q6_K if more else kq.Q4_K), i
        assert types[f"blk.{i}.ffn_down_exps.weight"] == (kq.Q6_K if more else kq.Q4_K), i
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate_exps", "ffn_up_exps"):
            assert types[f"blk.{i}.{part}.weight"] == kq.Q4_K, (i, part)
        for part in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp"):
            assert types[f"blk.{i}.{part}.weight"] == kq.F32, (i, part)
    assert len(MORE_BITS_48) == 24
    total = sum(w._nbytes(types[name], ne) for name, ne in w.tensor_table(w.QWEN3_30B_A3B))
    assert 17.0e9 < total < 18.6e9        # the ~17-18 GB of a Qwen3-30B-A3B Q4_K_M file


def test_eight_expert_models_and_fallbacks():
    assert w.q4_k_m_type("blk.5.attn_v.weight", (4096, 1024), 32, 8) == kq.Q8_0
    assert w.q4_k_m_type("blk.5.attn_k.weight", (4096, 1024), 32, 8) == kq.Q8_0
    assert w.q4_k_m_type("blk.5.attn_output.weight", (4096, 4096), 32, 8) == kq.Q5_K
    assert w.q4_k_m_type("blk.5.attn_output.weight", (4096, 4096), 32, 128) == kq.Q4_K
    assert w.q4_k_m_type("token_embd.weight", (4096, 32000), 32, 8, tied=True) == kq.Q6_K
    # rows of 128 weights: 256-weight K-quants fall back to 32-weight types
    assert w.q4_k_m_type("blk.0.ffn_down_exps.weight", (128, 256, 8), 2, 8) == kq.Q5_0
    assert w.q4_k_m_type("blk.1.ffn_down_exps.weight", (128, 256, 8), 2, 8) == kq.Q8_0
    assert w.q4_k_m_type("output.weight", (320, 1000), 2, 8) == kq.Q8_0


@pytest.mark.parametrize("qtype", [kq.Q4_K, kq.Q5_K, kq.Q6_K, kq.Q8_0, kq.Q5_0, kq.Q5_1])
def test_random_blocks_are_zero_mean_with_the_asked_spread(qtype):
    from gguf import GGMLQuantizationType, quants

    with ThreadPoolExecutor(2) as pool:
        blocks = kq.random_blocks(qtype, 128, 1024, 0.02, np.random.SeedSequence(3), pool)
    values = quants.dequantize(blocks, GGMLQuantizationType(qtype))
    assert values.shape == (128, 1024) and np.isfinite(values).all()
    assert abs(values.mean()) < 2e-4 and 0.019 < values.std() < 0.021
    # each sub-block is centred: block means stay at the sampling noise of their 32-256 values
    per_block = values.reshape(-1, kq.BLOCKS[qtype][0]).mean(axis=1)
    assert np.abs(per_block).mean() < 2 * 0.02 / np.sqrt(kq.BLOCKS[qtype][0])


def test_bytes_depend_on_the_seed_not_the_threads(tmp_path):
    digests = set()
    for threads in (1, 2):
        path = tmp_path / f"t{threads}.gguf"
        w.write_q4_k_m(path, w.TINY, seed=7, threads=threads, progress=None)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-q4km.gguf"
    counts = w.write_q4_k_m(path, w.TINY, seed=0, progress=None)
    return path, counts


def test_the_reader_reads_back_the_rule_and_the_metadata(tiny_file):
    from gguf import GGUFReader

    path, counts = tiny_file
    reader = GGUFReader(str(path))
    expected = _types(w.TINY)
    assert [t.name for t in reader.tensors] == [name for name, _ in w.tensor_table(w.TINY)]
    for t in reader.tensors:
        assert int(t.tensor_type) == expected[t.name], t.name
    assert counts["bytes"] == path.stat().st_size
    meta = {f.name: f for f in reader.fields.values()}

    def scalar(key):
        field = meta[key]
        return field.parts[field.data[0]].tolist()[0]

    assert bytes(meta["general.architecture"].parts[-1]).decode() == "qwen3moe"
    assert scalar("qwen3moe.block_count") == 2 and scalar("qwen3moe.expert_count") == 8
    assert scalar("qwen3moe.expert_used_count") == 2 and scalar("general.file_type") == 15
    assert len(meta["tokenizer.ggml.tokens"].data) == w.TINY.vocab


def test_freetoken_loads_the_file_and_gives_finite_logits(tiny_file, reference_moe_ops):
    from freetoken.models.loader import load_model
    from tests.models.helpers import PagedRunner

    loaded = load_model(str(tiny_file[0]), device="cpu")
    cfg = loaded.config
    assert cfg.architecture == "qwen3_moe" and cfg.num_layers == 2 and cfg.vocab_size == 512
    assert cfg.moe.num_experts == 8 and cfg.moe.top_k == 2 and cfg.moe.intermediate_size == 128
    runner = PagedRunner(loaded.model)
    prefill = runner.step([(0, [3, 17, 200, 45, 9, 301])])
    step = runner.step([(0, [77])])
    for logits in (prefill, step):
        assert logits.shape[-1] == 512 and torch.isfinite(logits).all()
        assert 0 < logits.float().std() < 10
    ids = loaded.tokenizer.encode("hello there\n")
    assert ids and all(0 <= i < 512 for i in ids)


def test_load_benchmarks_write_exact_prompts_and_chat_over_the_placeholder_vocabulary(tiny_file):
    """The placeholder vocabulary has no one-token words: prompts are runs of one-token
    characters, counted by the file's own tokenizer, and its ChatML template renders."""
    import random

    from benchmarks.load_workload import PromptWriter
    from freetoken.models.loader import load_model

    writer = PromptWriter(tiny_file[0])
    assert writer.separator == "" and len(writer.words) >= 20
    rng = random.Random(0)
    for length in (1, 17, 200):
        text, tokens = writer.write(length, rng)
        assert tokens == length == len(writer.tokenizer.encode(text))
    tokenizer = load_model(str(tiny_file[0]), device="cpu").tokenizer
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "ab12"}],
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nab12<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("bad", [["--layers", "0"], ["--layers", "99"], ["--sigma", "0"],
                                 ["--shape", "nope"]])
def test_the_writers_command_line_refuses_bad_values(tmp_path, bad, capsys):
    def never(*args):
        raise AssertionError("nothing is written for a refused command line")

    with pytest.raises(SystemExit) as exc:
        w.cli(w.SHAPES, "tiny", never, [str(tmp_path / "x.gguf"), "--shape", "tiny", *bad])
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
