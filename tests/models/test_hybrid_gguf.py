"""qwen3_next and qwen3_5_moe from GGUF files (llama.cpp's qwen3next and qwen35moe) on the CPU.

The models are test_hybrid_hf's tiny ones as llama.cpp serves them: 32-wide GDN heads (its
loader takes key and value heads of one width), two value heads per key head (so qwen35moe's
tiled value heads matter), an MoE MLP in every layer, and weights rounded to bfloat16 so that a
bf16 file holds them exactly. A bf16 file must then give the folder's logits and transformers'
within float32 rounding (assert_logits_close), greedy tokens included, over a chunked prefill
and decode steps (the recurrent states).

Q8_0 files stay in their blocks (moved by whole rows, joined), and their logits must be
transformers' on the dequantized weights within float32 rounding too: the CPU products run with
float32 activations over the exactly dequantized blocks (kernel/reference.py's contract; the
int8-activation kernels have their own tests in tests/kernel). With 8-bit activations these
random models' logits move by O(1): 0.5% noise on the weights does as much, flipping near-tied
expert choices, so no quantization tolerance would bound them.

Files come from llama.cpp's own converter where its sources are staged (.carry/llama-cpp, see
benchmarks/llama_cpp_cuda; CI has none), and from hybrid_gguf.py's writer everywhere; where both
are at hand, the writer must write what the converter writes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from freetoken.kernel.ops import Q8_0
from freetoken.models.errors import UnsupportedModelError
from freetoken.models.loader import load_model
from tests.models.helpers import PagedRunner, assert_logits_close
from tests.models.hybrid_gguf import write_hybrid_gguf
from tests.models.test_dense_hf import hf_last_logits, prompts
from tests.models.test_gguf_tiny import dequantized_reference
from tests.models.test_hybrid_hf import build_hybrid, float64_reference
from tests.tolerances import EPS

ARCHS = ("qwen3_5_moe", "qwen3_next")
# as llama.cpp serves them (see the module doc); widths are whole Q8_0 blocks
AS_LLAMA_CPP = dict(linear_key_head_dim=32, linear_value_head_dim=32,
                    shared_expert_intermediate_size=64)
EXTRA = {"qwen3_next": dict(mlp_only_layers=[]), "qwen3_5_moe": {}}
DECODE_STEPS = 3
FLOAT32_NOISE = 1e3     # ulps of the largest logit (see _greedy_agrees)


def _staged():
    from benchmarks.llama_cpp_cuda import paths

    folder = paths.staged_dir()
    return folder if (folder / paths.SOURCES).is_file() else None


needs_converter = pytest.mark.skipif(
    _staged() is None, reason="no staged llama.cpp sources (python -m benchmarks.llama_cpp_cuda "
                              "stage): the converter cannot run")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """arch -> (directory, transformers model): weights rounded to bfloat16, then saved."""
    built = {}

    def get(arch: str):
        if arch not in built:
            directory = tmp_path_factory.mktemp(f"hybrid-{arch}")
            hf = build_hybrid(arch, directory, **AS_LLAMA_CPP, **EXTRA[arch])
            with torch.no_grad():
                for p in hf.parameters():
                    p.copy_(p.to(torch.bfloat16))
            hf.save_pretrained(directory)
            built[arch] = (directory, hf)
        return built[arch]

    return get


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    """(arch, outtype) -> the folder converted by llama.cpp's convert_hf_to_gguf.py."""
    from benchmarks.llama_cpp_cuda.convert import convert

    made = {}
    home = os.environ.get("LCPP_HOME") or str(tmp_path_factory.mktemp("lcpp-home"))

    def get(arch: str, outtype: str):
        if (arch, outtype) not in made:
            directory, _ = folder(arch)
            out = tmp_path_factory.mktemp(f"converted-{arch}") / f"{arch}-{outtype}.gguf"
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("LCPP_HOME", home)    # where the staged sources are unpacked
                made[arch, outtype] = convert(directory, out, outtype, _staged())
        return made[arch, outtype]

    return get


@pytest.fixture(scope="module")
def written(folder, tmp_path_factory):
    """(arch, qtype or None for bf16) -> (path, transformers on exactly the file's values)."""
    made = {}

    def get(arch: str, qtype: int | None):
        if (arch, qtype) not in made:
            directory, hf = folder(arch)
            path = tmp_path_factory.mktemp(f"written-{arch}") / f"{arch}-{qtype}.gguf"
            state = write_hybrid_gguf(hf, directory, path, arch, qtype)
            made[arch, qtype] = (path, dequantized_reference(hf, state))
        return made[arch, qtype]

    return get


def _config_matches_folder(ours, reference) -> None:
    """The GGUF config describes the folder's model: the fields that differ are the file's
    norms holding 1 + w, qwen35moe's tiled value heads and llama.cpp's float32 epsilon."""
    import dataclasses

    assert ours.architecture == reference.architecture
    assert ours.norm_offset is False and reference.norm_offset is True
    tiled = ours.architecture == "qwen3_5_moe"
    assert ours.linear == dataclasses.replace(reference.linear, tiled_value_heads=tiled)
    assert ours.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    same = ("linear_layers", "moe", "rope_dim", "rope_theta", "head_dim", "num_kv_heads",
            "num_layers", "intermediate_size", "attn_output_gate", "qk_norm", "num_params")
    for name in same:
        assert getattr(ours, name) == getattr(reference, name), name


def _drive(runners: list[PagedRunner], hf, vocab: int, check) -> None:
    """Two sequences through every runner alike, as the engine mixes them: a's prompt in two
    chunks beside b's whole prompt and then b's decode steps, then both decoding greedy tokens
    (the first runner's). `check(rows, expected)` gets each runner's logits for one sequence
    and transformers' wherever a prompt is complete."""
    a, b = prompts(vocab)
    outs = [runner.step([(0, a[:10]), (1, b)]) for runner in runners]
    check([out[1] for out in outs], hf_last_logits(hf, b))
    b.append(int(outs[0][1].argmax()))
    outs = [runner.step([(0, a[10:]), (1, b[-1:])]) for runner in runners]
    for _ in range(DECODE_STEPS):
        for row, seq in ((0, a), (1, b)):
            check([out[row] for out in outs], hf_last_logits(hf, seq))
        a.append(int(outs[0][0].argmax()))
        b.append(int(outs[0][1].argmax()))
        outs = [runner.step([(0, a[-1:]), (1, b[-1:])]) for runner in runners]


def _greedy_agrees(ours, expected) -> None:
    """Same greedy token wherever transformers' top two are further apart than twice the
    float32 noise (assert_logits_close's bound on these models is ~1e3 ulps of the largest
    logit: 8 ulps times the root of ~1e4 accumulated terms)."""
    top2 = expected.topk(2).values
    if top2[0] - top2[1] > 2 * FLOAT32_NOISE * EPS["float32"] * float(expected.abs().max()):
        assert int(torch.as_tensor(ours).argmax()) == int(expected.argmax())


def _float32_check(config):
    """The GGUF load (rows[0]) against the folder's (rows[1]) and both against transformers,
    within float32 rounding."""
    def check(rows, expected):
        ours, folder = rows
        assert_logits_close(ours, folder, config, msg="GGUF vs the folder")
        for row in rows:
            assert_logits_close(row, expected, config)
        _greedy_agrees(ours, expected)

    return check


@pytest.fixture
def float_activations(monkeypatch, moe_ops):
    """The CPU's GGUF products (dense and experts) over exactly dequantized blocks with float32
    activations; the blocks stay as loaded (no repacking: packs_on_cpu sees the replacement)."""
    from freetoken.arrays import array_view
    from freetoken.kernel import ops, reference

    def quant_matmul(out, x, qweight, qtype):
        weight = reference.dequantize(torch.from_numpy(array_view(qweight)), qtype).numpy()
        np.matmul(array_view(x), weight.T, out=array_view(out))

    monkeypatch.setattr(ops, "quant_matmul", quant_matmul)
    monkeypatch.setattr(ops, "moe_experts_quant", reference.moe_experts_quant)


def _quantized_file_matches(path, reference) -> None:
    from freetoken.models.forward.linear import QuantLinear

    ours = load_model(str(path))
    first_gdn = ours.model.layers[ours.config.linear_layers.index(True)].attn
    assert isinstance(first_gdn.in_proj, QuantLinear)     # q, k, v, z, b, a joined as blocks
    assert isinstance(first_gdn.out_proj, QuantLinear)
    config = ours.config

    def check(rows, expected):
        assert_logits_close(rows[0], expected, config)
        _greedy_agrees(rows[0], expected)

    _drive([PagedRunner(ours.model)], reference, config.vocab_size, check)


def _bf16_file_matches(path, directory, hf) -> None:
    ours, reference = load_model(str(path)), load_model(str(directory))
    _config_matches_folder(ours.config, reference.config)
    _drive([PagedRunner(ours.model), PagedRunner(reference.model)], float64_reference(hf),
           reference.config.vocab_size, _float32_check(reference.config))


@needs_converter
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_bf16_gives_the_folder_and_transformers_logits(arch, folder, converted,
                                                                 moe_ops):
    directory, hf = folder(arch)
    _bf16_file_matches(converted(arch, "bf16"), directory, hf)


@needs_converter
@pytest.mark.parametrize("arch", ARCHS)
def test_converted_q8_0_stays_quantized_and_matches_transformers(arch, converted, written,
                                                                 float_activations):
    """The converter's Q8_0 file against transformers on its dequantized weights (the writer's
    reference: test_writer_writes_what_the_converter_writes checks it holds the same values)."""
    _quantized_file_matches(converted(arch, "q8_0"), written(arch, Q8_0)[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_written_bf16_gives_the_folder_and_transformers_logits(arch, folder, written, moe_ops):
    directory, hf = folder(arch)
    path, _ = written(arch, None)
    _bf16_file_matches(path, directory, hf)


@pytest.mark.parametrize("arch", ARCHS)
def test_written_q8_0_stays_quantized_and_matches_transformers(arch, written,
                                                               float_activations):
    _quantized_file_matches(*written(arch, Q8_0))


def test_older_qwen3next_files_with_a_fused_input_projection(folder, tmp_path, moe_ops):
    """Converters before the attn_qkv / attn_gate split kept in_proj_qkvz whole as ssm_in
    (llama.cpp still reads those files)."""
    directory, hf = folder("qwen3_next")
    path = tmp_path / "legacy.gguf"
    write_hybrid_gguf(hf, directory, path, "qwen3_next", legacy_qkvz=True)
    _bf16_file_matches(path, directory, hf)


@needs_converter
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_writer_writes_what_the_converter_writes(arch, outtype, converted, written):
    """Same architecture keys, tensor names, types, shapes and values: the files the CI tests
    read are llama.cpp's."""
    import gguf

    ours = gguf.GGUFReader(written(arch, Q8_0 if outtype == "q8_0" else None)[0])
    theirs = gguf.GGUFReader(converted(arch, outtype))
    arch_name = theirs.fields["general.architecture"].contents()
    assert ours.fields["general.architecture"].contents() == arch_name
    keys = {k for k in theirs.fields if k.startswith(arch_name + ".")}
    assert keys <= set(ours.fields), sorted(keys - set(ours.fields))
    for key in keys:
        assert ours.fields[key].contents() == pytest.approx(theirs.fields[key].contents()), key
    mine = {t.name: t for t in ours.tensors}
    assert set(mine) == {t.name for t in theirs.tensors}
    for tensor in theirs.tensors:
        other = mine[tensor.name]
        assert (other.tensor_type, list(other.shape)) == (tensor.tensor_type,
                                                          list(tensor.shape)), tensor.name
        assert np.array_equal(np.asarray(other.data), np.asarray(tensor.data)), tensor.name


def test_an_unserved_gguf_architecture_is_named(tmp_path):
    """Qwen3.5's dense models (llama.cpp's qwen35) are not served: the refusal names the file's
    architecture and lists the GGUF ones that are."""
    from gguf import GGUFWriter

    path = tmp_path / "dense.gguf"
    writer = GGUFWriter(str(path), "qwen35")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"'qwen35' is not supported.*GGUF .*"
                                                    r"qwen35moe.*qwen3next"):
        load_model(str(path))


def _hybrid_meta(arch: str, **extra) -> dict:
    """qwen35moe / qwen3next metadata as the converter writes it, for 4 trunk layers."""
    keys = {"block_count": 4, "embedding_length": 64, "attention.head_count": 4,
            "attention.head_count_kv": 2, "attention.key_length": 16,
            "attention.layer_norm_rms_epsilon": 1e-6, "expert_count": 8,
            "expert_used_count": 2, "expert_feed_forward_length": 32,
            "expert_shared_feed_forward_length": 48, "ssm.conv_kernel": 4,
            "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
            "ssm.inner_size": 64, "rope.dimension_count": 4, **extra}
    return {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in keys.items()}}


def test_gguf_hybrid_config_keys():
    """ssm.* as the GDN shape, the layer pattern from full_attention_interval when no
    recurrent_layers are listed, MTP blocks (nextn_predict_layers) left out of the trunk."""
    from freetoken.models.checkpoint.gguf_config import config_from_gguf

    routers = [f"blk.{i}.ffn_gate_inp.weight" for i in range(5)]
    cfg = config_from_gguf(_hybrid_meta("qwen3next", full_attention_interval=2), 300, "m.gguf",
                           routers)
    assert cfg.architecture == "qwen3_next" and cfg.linear_layers == (True, False) * 2
    assert (cfg.linear.num_k_heads, cfg.linear.num_v_heads, cfg.linear.head_k_dim,
            cfg.linear.head_v_dim) == (2, 4, 16, 16)
    assert not cfg.linear.tiled_value_heads and not cfg.norm_offset and cfg.attn_output_gate
    assert cfg.moe.renormalize and cfg.moe.shared_intermediate_size == 48
    meta = _hybrid_meta("qwen35moe", block_count=5, nextn_predict_layers=1,
                        **{"attention.recurrent_layers": [True, False, True, True, False]})
    cfg = config_from_gguf(meta, 300, "m.gguf", routers)
    assert cfg.architecture == "qwen3_5_moe" and cfg.num_layers == 4
    assert cfg.linear_layers == (True, False, True, True) and cfg.linear.tiled_value_heads
    assert cfg.intermediate_size == 48      # no dense MLP: the shared expert's, as from HF


def test_cpu_weight_bytes_of_a_hybrid_file_equal_what_the_loader_places(written):
    """The memory plan's count from the tensor table (footprint.py) covers the GDN tensors:
    the blocks the reader moves by rows and joins keep their bytes."""
    from freetoken.arrays import HostArrays
    from freetoken.models.checkpoint.footprint import weight_bytes
    from freetoken.models.checkpoint.gguf import read_gguf
    from freetoken.models.checkpoint.weights import Placement, build_decoder_weights
    from tests.models.test_footprint import placed_bytes

    config, tensors, _ = read_gguf(written("qwen3_5_moe", Q8_0)[0])
    where = Placement(HostArrays(), "float32")
    counted = weight_bytes(tensors, config, where)
    assert counted.other + counted.experts == placed_bytes(
        build_decoder_weights(tensors, config, where))


def test_the_engine_serves_a_qwen35moe_file(folder, written, moe_ops):
    """What `ft serve --model X.gguf` runs: chunked prefills beside decodes, recurrent-state
    slots and the prefix cache, with greedy tokens equal to transformers' on the same weights."""
    from freetoken.engine.config import EngineConfig
    from freetoken.engine.engine import Engine
    from tests.engine.test_hybrid_engine import hf_greedy, run_all

    _, hf = folder("qwen3_5_moe")
    loaded = load_model(str(written("qwen3_5_moe", None)[0]))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=gen).tolist()
               for n in (5, 23, 12)]
    config = EngineConfig(num_tokens=256, block_size=8, max_num_seqs=4, max_prefill_tokens=16,
                          kv_dtype="float32")
    engine = Engine.from_loaded(loaded, config).start()
    try:
        assert run_all(engine, prompts + prompts[:1]) == hf_greedy(float64_reference(hf),
                                                                   prompts + prompts[:1])
        assert engine.stats()["state_slots_used"] == 0
    finally:
        engine.shutdown()
