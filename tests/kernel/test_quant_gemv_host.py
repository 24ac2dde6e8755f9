"""Without a GPU: the FP8 decode GEMV's byte decoding (kernels/include/freetoken/fp8_words.h,
built for the host) against torch's float8 conversion, and which decode GEMV a quantized
projection picks under FREETOKEN_QUANT_GEMV."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from freetoken import env
from freetoken.models.forward import quant_gemv

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e4m3x4(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    so = tmp_path_factory.mktemp("fp8-host") / "fp8_words_host.so"
    subprocess.run([cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-Werror",
                    f"-I{REPO / 'kernels' / 'include'}",
                    str(Path(__file__).with_name("fp8_words_host.cc")), "-o", str(so)],
                   check=True)
    fn = ctypes.CDLL(str(so)).ft_e4m3x4_div256
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

    def decode(words: np.ndarray) -> np.ndarray:
        words = np.ascontiguousarray(words, dtype=np.uint32)
        out = np.full(4 * words.size, np.nan, dtype=np.float32)
        fn(words.ctypes.data, words.size, out.ctypes.data)
        return out

    return decode


def test_every_e4m3_code_in_every_byte_of_a_word_matches_torch(e4m3x4):
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    # each code once in each byte position, its neighbours differing (a byte mix-up shows)
    rolled = np.stack([np.roll(codes, 37 * i) for i in range(4)], axis=1)   # [codes, 4]
    words = rolled.copy().view(np.uint32).reshape(-1)                     # little-endian
    ours = e4m3x4(words).astype(np.float64) * 256.0
    expected = torch.from_numpy(rolled.reshape(-1)).view(torch.float8_e4m3fn).double().numpy()
    np.testing.assert_array_equal(ours, expected)


def test_gguf_gemv_reads_its_types_in_whole_16_byte_rows():
    assert quant_gemv.gguf_reads(12, 2304) and quant_gemv.gguf_reads(14, 3360)
    assert quant_gemv.gguf_reads(2, 2304) and quant_gemv.gguf_reads(8, 4352)
    assert not quant_gemv.gguf_reads(13, 2816)      # Q5_K: gguf_matmul only
    assert not quant_gemv.gguf_reads(14, 210)       # one Q6_K block: not whole words


def test_fp8_gemv_reads_power_of_two_or_whole_row_blocks():
    assert quant_gemv.fp8_reads(0, (128, 128), 4096)
    assert quant_gemv.fp8_reads(0, (1, 4096), 4096)          # per channel
    assert quant_gemv.fp8_reads(0, (4096, 4096), 4096)       # per tensor
    assert quant_gemv.fp8_reads(0, (1, 336), 336)            # one block across the row
    assert not quant_gemv.fp8_reads(0, (128, 96), 4096)      # 96 wide: scaled_gemv
    assert not quant_gemv.fp8_reads(1, (1, 16), 2048)        # NVFP4: scaled_gemv
    assert not quant_gemv.fp8_reads(0, (128, 128), 4104)     # rows not whole words


def test_gguf_gemv_q8_reads_steps_within_its_staging():
    assert quant_gemv.q8_reads(12, 4096, 1) and quant_gemv.q8_reads(12, 12288, 2)
    assert quant_gemv.q8_reads(12, 32768, 1) and not quant_gemv.q8_reads(12, 32768, 2)
    # Q4_K, Q6_K and Q8_0 take up to 8 tokens, the other types 2; x within the staging
    assert quant_gemv.q8_reads(12, 4096, 3) and quant_gemv.q8_reads(12, 4096, 8)
    assert not quant_gemv.q8_reads(12, 4096, 9) and not quant_gemv.q8_reads(12, 8192, 5)
    assert quant_gemv.q8_reads(14, 3072, 8) and quant_gemv.q8_reads(8, 2048, 8)
    assert not quant_gemv.q8_reads(2, 256, 3) and not quant_gemv.q8_reads(13, 256, 3)
    assert [quant_gemv.q8_max_tokens(qt, k) for qt, k in
            ((12, 2048), (12, 8192), (14, 12288), (2, 256), (10, 256))] == [8, 4, 2, 2, 0]
    # the staged types: less room; any row of whole blocks (the GPU pads rows to 16 bytes)
    assert quant_gemv.q8_reads(14, 4096, 2) and quant_gemv.q8_reads(14, 12288, 2)
    assert not quant_gemv.q8_reads(14, 16384, 2) and quant_gemv.q8_reads(14, 256, 1)
    assert not quant_gemv.q8_reads(14, 200, 1)
    assert quant_gemv.q8_reads(8, 256, 1) and quant_gemv.q8_reads(8, 32, 1)
    assert quant_gemv.q8_reads(13, 256, 1) and quant_gemv.q8_reads(3, 128, 1)
    assert quant_gemv.q8_reads(6, 256, 1) and quant_gemv.q8_reads(7, 64, 1)   # Q5_0, Q5_1
    assert not quant_gemv.q8_reads(10, 256, 1)                # Q2_K: not read


def test_variant_is_read_and_checked(monkeypatch):
    assert env.read({}).quant_gemv == "v3"
    assert env.read({"FREETOKEN_QUANT_GEMV": " V1 "}).quant_gemv == "v1"
    assert env.read({"FREETOKEN_QUANT_GEMV": " V2 "}).quant_gemv == "v2"
    assert env.read({"FREETOKEN_QUANT_GEMV": "v3"}).quant_gemv == "v3"
    with pytest.raises(env.EnvError, match="FREETOKEN_QUANT_GEMV='v4'; use v1, v2 or v3"):
        env.read({"FREETOKEN_QUANT_GEMV": "v4"})
    assert "FREETOKEN_QUANT_GEMV" in env.VARIABLES
    assert "FREETOKEN_QUANT_GEMV" in (REPO / "docs" / "environment.md").read_text()


def test_v1_binds_no_new_kernel(monkeypatch):
    """Under v1 the projections keep gguf_matmul / scaled_gemv: nothing is bound,
    so no build of quant_gemv is needed."""
    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v1")
    weight = torch.zeros(4, 144, dtype=torch.uint8)
    assert quant_gemv.gguf_decode(12, weight) is None
    assert quant_gemv.fp8_decode(0, (128, 128), torch.zeros(4, 128, dtype=torch.uint8)) is None


def test_v2_binds_only_weights_it_reads(monkeypatch):
    from types import SimpleNamespace

    def on_gpu(rows, cols):   # a weight's shape and device as the selection reads them
        return SimpleNamespace(shape=(rows, cols), device=torch.device("cuda"))

    bound = []
    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v2")
    monkeypatch.setattr("freetoken.kernel.ops.bind", lambda name, dev: bound.append(name) or name)
    assert quant_gemv.gguf_decode(12, on_gpu(4, 144)) == "gguf_gemv"
    assert quant_gemv.gguf_decode(13, on_gpu(4, 176)) is None
    assert quant_gemv.fp8_decode(0, (128, 128), on_gpu(4, 128)) == "fp8_gemv"
    # host tensors (the CPU path, or a test's stand-in for a GPU placement) keep v1
    assert quant_gemv.gguf_decode(12, torch.zeros(4, 144, dtype=torch.uint8)) is None
    assert quant_gemv.q8_decode(12, 256, on_gpu(4, 144)) is None      # v3 only
    assert bound == ["gguf_gemv", "fp8_gemv"]


def test_v3_adds_the_int8_gemv_where_it_reads(monkeypatch):
    from types import SimpleNamespace

    def on_gpu(rows, cols):
        return SimpleNamespace(shape=(rows, cols), device=torch.device("cuda"))

    bound = []
    monkeypatch.setenv("FREETOKEN_QUANT_GEMV", "v3")
    monkeypatch.setattr("freetoken.kernel.ops.bind", lambda name, dev: bound.append(name) or name)
    assert quant_gemv.q8_decode(12, 256, on_gpu(4, 144)) == "gguf_gemv_q8"
    assert quant_gemv.gguf_decode(12, on_gpu(4, 144)) == "gguf_gemv"     # T 3-8 keep v2
    assert quant_gemv.q8_decode(14, 256, on_gpu(4, 210)) is None          # not whole words
    assert quant_gemv.q8_decode(12, 65536, on_gpu(4, 36864)) is None     # past the staging
    assert quant_gemv.q8_decode(12, 256, torch.zeros(4, 144, dtype=torch.uint8)) is None
    assert bound == ["gguf_gemv_q8", "gguf_gemv"]


def test_sweep_picks_the_fastest_variant_that_passed():
    from benchmarks.quant_gemv_sweep import LAYER, best

    def row(variant, shape, us, ok=True):
        return {"type": "q4_k", "tokens": 1, "variant": variant, "shape": shape, "us": us,
                "ok": ok}

    rows = [row("v1", s, 10.0) for s in LAYER] + [row("v2/r1", s, 4.0) for s in LAYER]
    rows += [row("v2/r2", s, 1.0, ok=s != "o") for s in LAYER]      # fastest, but one failed
    rows += [row("v2/r1", "k|v", 1e6)]                               # not a layer shape
    (b,) = best(rows)
    assert b["best"] == "v2/r1" and b["speedup_over_v1"] == pytest.approx(2.5)
    assert b["layer_us"] == {"v1": 40.0, "v2/r1": 16.0, "v2/r2": 4.0}


def test_rows_per_warp_follow_the_measured_table():
    """One-token steps take the sweep's rows per warp; wider steps leave it to the kernel."""
    from freetoken.models.forward import quant_gemv

    assert [quant_gemv.gguf_rows(t, 1) for t in (2, 8, 12, 14)] == [4, 4, 1, 4]
    assert quant_gemv.gguf_rows(12, 4) == 0 and quant_gemv.gguf_rows(99, 1) == 0
    assert quant_gemv.fp8_rows(1) == 2 and quant_gemv.fp8_rows(3) == 0
