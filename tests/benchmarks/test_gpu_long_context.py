"""benchmarks/gpu_long_context.py without a GPU: the ceiling of a decode row against a hand
computation from each shape's config numbers, llama.cpp's commands and the parsing of their
output, and bad arguments refused, naming the flag, before any GPU work."""

import sys
from pathlib import Path

import pytest

from benchmarks import gpu_decode, gpu_long_context as lc
from benchmarks.gpu_hybrid import QWEN36_35B_A3B

QWEN3_8B = dict(gpu_decode.CONFIGS["qwen3-8b"][2])
# the 8-layer hybrid as its config.json says: every 4th layer full attention
QWEN36 = {**QWEN36_35B_A3B, "num_hidden_layers": 8,
          "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}
BANDWIDTH = 3.0e12


def test_qwen3_8b_ceiling_is_weights_plus_every_sequences_kv():
    kv_per_token = 8 * 2 * 8 * 128 * 2     # layers x (K, V) x kv heads x head dim x bf16
    weights = {"weights": 3_200_000_000, "experts": 0}
    for batch, depth in [(1, 65536), (8, 131072)]:
        context = depth + 32                 # the mean context of 64 timed tokens
        step = 3_200_000_000 + batch * kv_per_token * context
        assert lc.step_read_bytes(weights, QWEN3_8B, batch, context) == step
        assert lc.ceiling_tok_s(weights, QWEN3_8B, batch, depth, 64, BANDWIDTH) == \
            pytest.approx(batch * BANDWIDTH / step)
    assert lc.kv_bytes(QWEN3_8B, 1000) == 1000 * kv_per_token


def test_hybrid_ceiling_counts_two_kv_layers_six_states_and_the_experts_a_batch_reaches():
    kv_per_token = 2 * 2 * 2 * 256 * 2      # 2 full layers x (K, V) x 2 kv heads x 256 x bf16
    conv = 2 * 16 * 128 + 32 * 128         # q, k (16 heads of 128) and v (32 of 128) channels
    state = 2 * (32 * 128 * 128 * 4 + conv * 3 * 2)    # f32 state + bf16 conv window, r + w
    dense, routed = 1_500_000_000, 400_000_000          # routed: at 8 of 256 experts
    weights = {"weights": dense + routed, "experts": routed}
    for batch, reached in [(1, 8.0), (8, 256 * (1 - (248 / 256) ** 8))]:
        step = dense + routed / 8 * reached + batch * (6 * state + kv_per_token * 16416)
        assert lc.step_read_bytes(weights, QWEN36, batch, 16416) == pytest.approx(step)
        assert lc.ceiling_tok_s(weights, QWEN36, batch, 16384, 64, BANDWIDTH) == \
            pytest.approx(batch * BANDWIDTH / step)
    assert lc.kv_bytes(QWEN36, 1000) == 1000 * kv_per_token


def test_fp8_kv_rows_count_one_byte_an_element_plus_a_scale_per_token_and_head():
    # a token of Qwen3-8B's pool: layers x (K, V) x kv heads x (128 codes + a float32 scale)
    kv_per_token = 8 * 2 * 8 * (128 + 4)
    weights = {"weights": 3_200_000_000, "experts": 0}
    row = {"kind": "decode", "batch": 1, "depth": 65536, "kv_dtype": "fp8"}
    item = lc.row_kv_item(QWEN3_8B, row)
    assert lc.kv_bytes(QWEN3_8B, 1000, item) == pytest.approx(1000 * kv_per_token)
    step = 3_200_000_000 + kv_per_token * (65536 + 32)
    assert lc.ceiling_tok_s(weights, QWEN3_8B, 1, 65536, 64, BANDWIDTH, item) == \
        pytest.approx(BANDWIDTH / step)
    need = (65536 + 64 + 16) * kv_per_token
    assert lc.too_big(QWEN3_8B, row, 64, int(need) + lc.MARGIN + 1) is None
    assert lc.too_big(QWEN3_8B, row, 64, int(need) + lc.MARGIN - 1)


def test_fp8_rows_have_their_own_keys_and_llama_cpp_runs_its_8_bit_cache(tools):
    args = lc.parse_args(["--shapes", "qwen3-8b", "--depths", "65536", "--batch-sizes", "1",
                          "--prefills", "", "--kv-dtype", "fp8"])
    rows = lc.shape_rows("qwen3-8b", args)
    assert list(rows) == ["qwen3-8b bs1 d65536 kv-fp8"]
    row = dict(rows["qwen3-8b bs1 d65536 kv-fp8"], key="k")
    assert row["kv_dtype"] == "fp8"
    lc.llamacpp(Path("/w/m.gguf"), [row], 64)
    command = tools[0]
    assert command[command.index("-ctk") + 1] == "q8_0"
    assert command[command.index("-ctv") + 1] == "q8_0"
    plain = dict(lc.shape_rows("qwen3-8b", lc.parse_args(["--depths", "65536", "--prefills", "",
                                                         "--batch-sizes", "1"]))
                 ["qwen3-8b bs1 d65536"], key="p")
    lc.llamacpp(Path("/w/m.gguf"), [plain], 64)
    assert "-ctk" not in tools[1]


def test_a_row_too_big_for_the_gpu_says_how_big():
    row = {"kind": "decode", "batch": 8, "depth": 131072}
    need = 8 * (131072 + 64 + 16) * 8 * 2 * 8 * 128 * 2
    assert lc.too_big(QWEN3_8B, row, 64, need + lc.MARGIN) is None
    why = lc.too_big(QWEN3_8B, row, 64, need)
    assert f"{need / lc.GIB:.1f} GiB" in why and "free" in why


# llama-bench -o jsonl at one depth (the device lines go to stderr, appended by run_tool)
BENCH_DEPTH = """\
{"build_commit": "b0c1a6e", "build_number": 6650, "cpu_info": "AMD EPYC 9454 48-Core \
Processor", "gpu_info": "NVIDIA H100 80GB HBM3", "backends": "CUDA", "model_filename": \
"/tmp/w/qwen3-8b.bf16.gguf", "model_type": "qwen3 8B BF16", "model_size": 5702098944, \
"model_n_params": 2851049472, "n_batch": 2048, "n_ubatch": 2048, "n_threads": 16, \
"type_k": "f16", "type_v": "f16", "n_gpu_layers": 99, "flash_attn": true, "n_prompt": 0, \
"n_gen": 64, "n_depth": 65536, "test_time": "2026-10-12T09:14:03Z", "avg_ns": 101234000, \
"stddev_ns": 234000, "avg_ts": 632.187, "stddev_ts": 1.464, "samples_ns": [101000000, \
101500000, 101200000], "samples_ts": [633.6, 630.5, 632.4]}

ggml_cuda_init: found 1 CUDA devices:
  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes
"""
BATCHED = """\
ggml_cuda_init: found 1 CUDA devices:
llama_context: n_ctx = 1049344
{"n_kv_max": 1049344, "n_batch": 2048, "n_ubatch": 2048, "flash_attn": 1, "is_pp_shared": 0, \
"n_gpu_layers": 99, "n_threads": 16, "n_threads_batch": 16, "pp": 65536, "tg": 64, "pl": 8, \
"n_kv": 524800, "t_pp": 41.523, "speed_pp": 12626.3, "t_tg": 0.912, "speed_tg": 561.40, \
"t": 42.435, "speed": 12367.4}
"""
BENCH_PREFILL = """\
{"model_type": "qwen3 8B BF16", "n_batch": 2048, "n_ubatch": 2048, "n_prompt": 32768, \
"n_gen": 0, "n_depth": 0, "avg_ts": 41234.5, "stddev_ts": 88.1}
{"model_type": "qwen3 8B BF16", "n_batch": 2048, "n_ubatch": 2048, "n_prompt": 131072, \
"n_gen": 0, "n_depth": 0, "avg_ts": 22760.2, "stddev_ts": 40.3}
"""


@pytest.fixture
def tools(monkeypatch):
    """llama.cpp's tools faked: each command is recorded and answered with sample output."""
    from benchmarks.llama_cpp_cuda import bench, paths

    ran = []

    def run_tool(command, vram=False):
        ran.append(command)
        if Path(command[0]).name == "llama-batched-bench":
            return 0, BATCHED, None
        if "-d" in command:
            return 0, BENCH_DEPTH if command[command.index("-d") + 1] == "65536" else \
                "error: failed to allocate CUDA0 buffer", None
        return 0, BENCH_PREFILL, None

    monkeypatch.setattr(paths, "tool", lambda name: Path("/peer/build/bin") / name)
    monkeypatch.setattr(bench, "run_tool", run_tool)
    return ran


def test_llama_cpp_rows_are_parsed_from_its_json_lines(tools):
    rows = [dict(kind="decode", batch=b, depth=d, key=f"bs{b} d{d}")
            for d in (65536, 131072) for b in (1, 8)]
    rows += [dict(kind="prefill", prompt=p, key=f"prefill {p}") for p in (32768, 131072)]
    lc.llamacpp(Path("/w/m.gguf"), rows, 64)
    cells = {r["key"]: r["llama.cpp"] for r in rows}
    assert cells["bs1 d65536"] == {"tok_s": 632.19}
    assert cells["bs8 d65536"] == {"tok_s": 561.4}
    assert cells["prefill 32768"] == {"tok_s": 41234.5}
    assert cells["prefill 131072"] == {"tok_s": 22760.2}
    assert "failed to allocate" in cells["bs1 d131072"]["skipped"]
    bench_d64k, batched_d64k = tools[0], tools[1]
    assert bench_d64k[0].endswith("llama-bench")
    for flag, value in [("-p", "0"), ("-n", "64"), ("-d", "65536"), ("-ngl", "99"),
                        ("-fa", "1"), ("-o", "jsonl")]:
        assert bench_d64k[bench_d64k.index(flag) + 1] == value
    assert batched_d64k[0].endswith("llama-batched-bench")
    for flag, value in [("-npp", "65536"), ("-ntg", "64"), ("-npl", "8"),
                        ("-c", str(8 * (65536 + 64) + 256))]:
        assert batched_d64k[batched_d64k.index(flag) + 1] == value
    prefill = tools[-1]
    for flag, value in [("-p", "32768,131072"), ("-n", "0"), ("-ub", "2048"), ("-b", "2048")]:
        assert prefill[prefill.index(flag) + 1] == value


@pytest.mark.parametrize("flags", [["--depths", "4096,abc"], ["--depths", "0,4096"],
                                   ["--batch-sizes", "1,x"], ["--batch-sizes", ""],
                                   ["--prefills", "-5"], ["--shapes", "qwen3-8b,llama-70b"],
                                   ["--engines", "freetoken,vllm"], ["--gen", "1"],
                                   ["--kv-dtype", "int4"]])
def test_bad_arguments_exit_naming_the_flag(flags, monkeypatch):
    def no_gpu():
        raise AssertionError("GPU work before the arguments were checked")

    monkeypatch.setattr(lc.gpu_decode, "d2d_bandwidth", no_gpu)
    monkeypatch.setattr(sys, "argv", ["gpu_long_context.py", *flags])
    with pytest.raises(SystemExit) as exc:
        lc.main()
    assert flags[0] in str(exc.value)


def test_goals_name_the_rows_behind():
    def row(kind, ours, peer, **fields):
        return {"kind": kind, "shape": "qwen3-8b", "freetoken": ours, "llama.cpp": peer,
                **fields}

    rows = [row("decode", {"tok_s": 720.0}, {"tok_s": 700.0}, batch=1, depth=65536, key="a",
                ceiling_tok_s=1000.0),
            row("decode", {"tok_s": 500.0}, {"tok_s": 600.0}, batch=8, depth=65536, key="b",
                ceiling_tok_s=5000.0),
            row("prefill", {"tok_s": 30000.0}, {"skipped": "no build"}, prompt=131072, key="c")]
    lines = lc.goals(rows)
    assert lines[0] == "faster than llama.cpp at every depth: no: b"
    assert "72% of the ceiling" in lines[1]
    assert lines[2].endswith("not measured")
