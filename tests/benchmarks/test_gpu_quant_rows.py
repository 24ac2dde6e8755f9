"""The quantized rows' CPU parts: which files a later row still needs, the step bytes from a
file's own tensor table, and the FP8 / NVFP4 folders (bytes as the tested quantizers make
them, read by FreeToken's loader as scaled weights, logits of the values those bytes hold)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_quant_rows as rows
from benchmarks import scaled_folder, step_bytes
from benchmarks import write_gguf_moe as w


def test_rows_and_what_later_rows_need(tmp_path):
    assert set(rows.ROWS) >= {"qwen3-8b-q4km", "qwen3-30b-a3b-q8_0", "qwen3.6-35b-a3b-nvfp4",
                              "qwen3-30b-a3b-fp8"}
    row = rows.ROWS["qwen3-8b-q4km"]
    assert row.is_gguf and row.artifact(tmp_path) == tmp_path / "qwen3-8b-q4km.gguf"
    assert rows.needed_later(row, [], tmp_path) == (False, False)
    assert rows.needed_later(row, ["qwen3-8b-q8_0"], tmp_path) == (True, True)
    assert rows.needed_later(row, ["qwen3-8b-fp8", "qwen3-30b-a3b-q8_0"], tmp_path) == \
        (True, False)
    assert rows.needed_later(row, ["qwen3-8b"], tmp_path) == (True, False)
    (tmp_path / "qwen3-8b-q8_0.gguf").write_bytes(b"")         # made by an earlier call
    assert rows.needed_later(row, ["qwen3-8b-q8_0"], tmp_path) == (False, False)


def test_gguf_step_bytes_from_the_tensor_table(tmp_path):
    path = tmp_path / "t.gguf"
    w.write_q4_k_m(path, w.TINY, progress=None)
    shape, expected, experts = w.TINY, 0.0, 0.0
    for name, ne in w.tensor_table(shape):
        if name == "token_embd.weight":           # untied: one row read, not counted
            continue
        nbytes = w._nbytes(w.q4_k_m_type(name, ne, shape.layers, shape.experts), ne)
        if "_exps" in name:
            nbytes *= shape.top_k / shape.experts
            experts += nbytes
        expected += nbytes
    got = step_bytes.gguf_weight_bytes(path)
    assert got["weights"] == int(expected) and got["experts"] == int(experts)
    assert set(got["by_type"]) == {"F32", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "Q8_0"}


@pytest.fixture(scope="module")
def float_moe(tmp_path_factory):
    from tests.models.helpers import tiny_hf_model

    folder = tmp_path_factory.mktemp("float-moe")
    model = tiny_hf_model("qwen3_moe", folder)
    return folder, model


def test_safetensors_step_bytes_and_context(float_moe):
    folder, model = float_moe
    cfg = model.config
    expected = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        nbytes = p.numel() * 4
        expected += nbytes * (cfg.num_experts_per_tok / cfg.num_experts
                              if ".experts." in name else 1)
    got = step_bytes.safetensors_weight_bytes(folder)
    assert abs(got["weights"] - expected) <= 1 and got["by_type"].keys() == {"F32"}
    config = json.loads((folder / "config.json").read_text())
    kv = 2 * cfg.num_key_value_heads * cfg.head_dim * 2        # K and V, 2 bytes each
    assert step_bytes.context_bytes(config, 100) == cfg.num_hidden_layers * kv * 100


def test_context_bytes_of_a_hybrid_config():
    config = {"text_config": {
        "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}}
    conv = 2 * 16 * 128 + 32 * 128
    state = 2 * (4 * 32 * 128 * 128 + 2 * conv * 3)          # f32 state + bf16 window, r+w
    assert step_bytes.context_bytes(config, 10) == 3 * state + 2 * 2 * 256 * 2 * 10


def test_quantizers_match_the_tested_ones():
    from tests.models.scaled_checkpoint import quantize_fp8, quantize_nvfp4

    w3 = torch.randn(3, 96, 320, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = scaled_folder.fp8_blocks(w3)
    q_ref, scale_ref = quantize_fp8(w3, 128, 128)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scale, scale_ref)
    mine, ref = scaled_folder.nvfp4_groups(w3), quantize_nvfp4(w3)
    for a, b in zip(mine, ref):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b)


def _dequantized(folder: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The float values the quantized folder's bytes hold (decoded by the test reference)."""
    from safetensors import safe_open

    from tests.models.scaled_checkpoint import e2m1_values, e4m3_values, expand

    out = {}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in names:
            t = f.get_tensor(name)
            if not scaled_folder.LINEAR.search(name):
                if "scale" not in name:
                    out[name] = t
                continue
            if fmt == "fp8":
                grid = f.get_tensor(scaled_folder.companion(name, "weight_scale_inv"))
                rows, cols = t.shape[-2:]
                values = e4m3_values(t.view(torch.uint8).numpy()) * expand(
                    grid.double().numpy(), 128, 128, rows, cols)
            else:
                local = f.get_tensor(scaled_folder.companion(name, "weight_scale"))
                second = f.get_tensor(scaled_folder.companion(name, "weight_scale_2"))
                rows, cols = t.shape[-2], 2 * t.shape[-1]
                values = e2m1_values(t.numpy()) * expand(
                    e4m3_values(local.view(torch.uint8).numpy()), 1, 16, rows, cols) \
                    * second.double().numpy()
            out[name] = torch.from_numpy(values).float()
    return out


@pytest.mark.parametrize("fmt", scaled_folder.FORMATS)
def test_scaled_folder_loads_and_gives_the_logits_of_its_values(fmt, float_moe, tmp_path,
                                                                reference_moe_ops):
    from safetensors.torch import save_file

    from freetoken.models.checkpoint.hf import read_hf_dir
    from freetoken.models.loader import load_model
    from freetoken.models.quant import scaled
    from tests.models.helpers import PagedRunner, assert_logits_close

    folder, _ = float_moe
    out = scaled_folder.write_scaled(folder, tmp_path / fmt, fmt)
    _, tensors, _, _ = read_hf_dir(out)
    for canonical in ("layers.0.q", "layers.1.o", "layers.0.experts.gate"):
        weight = tensors.get(canonical)
        assert isinstance(weight, scaled.ScaledWeight), canonical
        assert weight.format == (scaled.FP8 if fmt == "fp8" else scaled.NVFP4)
    assert isinstance(tensors.get("lm_head"), torch.Tensor)
    reference = tmp_path / "reference"
    reference.mkdir()
    save_file(_dequantized(out, fmt), str(reference / "model.safetensors"))
    for extra in folder.iterdir():
        if extra.suffix != ".safetensors":
            (reference / extra.name).write_bytes(extra.read_bytes())
    ours, theirs = load_model(str(out)), load_model(str(reference))
    chunk = [(0, [5, 17, 40, 99, 3])]
    assert_logits_close(PagedRunner(ours.model).step(chunk),
                        PagedRunner(theirs.model).step(chunk), theirs.config)
    weights = step_bytes.safetensors_weight_bytes(out)
    assert weights["by_type"].get("F8_E4M3" if fmt == "fp8" else "U8", 0) > 0
    assert weights["weights"] < step_bytes.safetensors_weight_bytes(folder)["weights"]


def test_rows_are_made_measured_and_cleaned_up(tmp_path, monkeypatch, capsys):
    """gpu_vs_llamacpp's row loop with the GPU parts stood in for: an FP8 row is made from the
    base folder and measured by FreeToken alone; a GGUF row without a llama.cpp build says why
    for both engines; the base folder stays while a later row needs it."""
    from argparse import Namespace
    from types import SimpleNamespace

    from benchmarks import gpu_vs_llamacpp as g
    from tests.models.helpers import tiny_hf_model

    built = []

    def build_shape(name, directory, context):
        built.append(name)
        tiny_hf_model("qwen3", directory)
        return 10 ** 6

    ran = []
    monkeypatch.setattr(g, "build_shape", build_shape)
    monkeypatch.setattr(g, "freetoken", lambda source, gen: ran.append(source) or
                        {"decode_bs1": 50.0, "prefill512": 1000.0})
    args = Namespace(engines={"freetoken", "llama.cpp"}, peer=None, gen=8, work=tmp_path)
    peer = SimpleNamespace(reason=lambda: "no llama.cpp build here", staged=None)
    shapes, results = ["qwen3-8b-fp8", "qwen3-8b-q4km", "qwen3-8b"], {}
    for i, name in enumerate(shapes):
        g.measure(name, tmp_path, args, 1e12, results.setdefault(name, {}), shapes[i + 1:], peer)
    fp8, q4km, bf16 = (results[s] for s in shapes)
    assert built == ["qwen3-8b"]
    assert ran == [str(tmp_path / "qwen3-8b-fp8"), str(tmp_path / "qwen3-8b")]
    assert fp8["freetoken"]["decode_bs1"] == 50.0
    assert "FreeToken-only" in fp8["llama.cpp"]["skipped"]
    assert fp8["ceiling_tok_s"] == pytest.approx(1e12 / fp8["step_bytes"])
    assert "llama-quantize" in q4km["freetoken"]["skipped"] and "ceiling_tok_s" not in q4km
    assert bf16["llama.cpp"] == {"skipped": "no llama.cpp build here"}
    assert (tmp_path / "qwen3-8b").is_dir()          # the bf16 row used it last; --work keeps it
    assert not (tmp_path / "qwen3-8b-fp8").exists()  # measured by the one engine that reads it
    g.summary(results, shapes)
    assert "qwen3-8b-fp8" in capsys.readouterr().out
