"""benchmarks/llama_cpp_cuda without a GPU or a llama.cpp build: the placeholder vocabulary,
staging from an sdist, the build's commands, state and error line, and the parsing of the
tools' JSON output. The converter itself runs when staged sources are at hand."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.llama_cpp_cuda import bench, build, paths, stage
from benchmarks.llama_cpp_cuda.vocab import CONTROL, MERGES, placeholder_vocab


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LCPP_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_placeholder_vocab_is_a_byte_level_bpe_of_the_asked_size():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokens, types, merges = placeholder_vocab(1000)
    assert len(tokens) == len(types) == 1000 and len(set(tokens)) == 1000
    assert set(tokens[:256]) == set(pre_tokenizers.ByteLevel.alphabet())
    assert tokens[32] == "Ġ" and tokens[10] == "Ċ"      # GPT-2's symbols for space, newline
    assert tokens[-3:] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert types[-3:] == [CONTROL] * 3
    assert all(left + right in tokens for left, right in MERGES)
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                   [tuple(m.split(" ")) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert backend.encode("the\n").ids == [tokens.index("the"[0]), tokens.index("he"),
                                          tokens.index("Ċ")]
    with pytest.raises(ValueError):
        placeholder_vocab(100)


def _fake_sdist(path: Path) -> Path:
    """A llama-cpp-python-like sdist: a few kept and dropped files, one path over 100 bytes."""
    root = "llama_cpp_python-9.9/vendor/llama.cpp/"
    files = {"CMakeLists.txt": "project(x)", "convert_hf_to_gguf.py": "print('hi')",
             "ggml/src/ggml-cuda/template-instances/" + "x" * 90 + ".cu": "// long",
             "gguf-py/gguf/__init__.py": "", "tools/ui/src/app.ts": "ui",
             "tools/ui/CMakeLists.txt": "ui", "docs/build.md": "docs",
             "models/ggml-vocab-x.gguf": "vocab", "scripts/ui-assets.cmake": "#",
             "scripts/other.sh": "#"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {**{root + k: v for k, v in files.items()},
                           "llama_cpp_python-9.9/setup.py": ""}.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_stage_packs_what_the_build_and_converter_need(tmp_path, home):
    sdist = _fake_sdist(tmp_path / "llama_cpp_python-9.9.tar.gz")
    manifest = stage.stage(tmp_path / "staged", sdist=sdist)
    with tarfile.open(tmp_path / "staged" / paths.SOURCES) as tar:
        names = set(tar.getnames())
    assert names == {"CMakeLists.txt", "convert_hf_to_gguf.py", "gguf-py/gguf/__init__.py",
                     "ggml/src/ggml-cuda/template-instances/" + "x" * 90 + ".cu",
                     "tools/ui/CMakeLists.txt", "scripts/ui-assets.cmake"}
    assert manifest["files"] == 6
    assert json.loads((tmp_path / "staged" / paths.MANIFEST).read_text())["sdist"] == sdist.name
    src = paths.sources(tmp_path / "staged")         # unpacked once, into $LCPP_HOME/src
    assert src == home / "src" and (src / "convert_hf_to_gguf.py").read_text() == "print('hi')"
    assert paths.sources(tmp_path / "nowhere") == src


def test_missing_sources_and_tools_say_what_to_run(tmp_path, home):
    with pytest.raises(paths.PeerUnavailable, match="benchmarks.llama_cpp_cuda stage"):
        paths.sources(tmp_path / "nowhere")
    with pytest.raises(paths.PeerUnavailable, match="no llama.cpp build"):
        paths.tool("llama-bench")
    build._write_state(status="failed", error="cmake configure: boom")
    with pytest.raises(paths.PeerUnavailable, match="failed: cmake configure: boom"):
        paths.tool("llama-bench")


def test_build_commands(tmp_path, monkeypatch):
    command = build.configure_command(tmp_path / "src", tmp_path / "b", "90a")
    for flag in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90a", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in command
    assert "-DGGML_CUDA=OFF" in build.configure_command(tmp_path, tmp_path, "90a", cuda=False)
    assert build.build_command(tmp_path, 16)[-6:] == list(paths.TOOLS)

    def smi(answer):
        def run(*args, **kwargs):
            return subprocess.CompletedProcess(args, 0, stdout=answer, stderr="")
        return run

    monkeypatch.delenv("CUDA_ARCH", raising=False)
    for answer, arch in (("9.0\n", "90a"), ("8.9\n", "89"), ("", "90a")):
        monkeypatch.setattr(build.subprocess, "run", smi(answer))
        assert build.gpu_arch() == arch
    monkeypatch.setenv("CUDA_ARCH", "86")
    assert build.gpu_arch() == "86"


def test_first_error_is_one_line(tmp_path):
    log = tmp_path / "cmake.log"
    log.write_text("-- ok\nfatal: not a git repository\nCMake Error at x.txt:3 (message):\n"
                   "  CUDA::cublas\n  was not found\n\n-- done\n")
    assert build.first_error(log) == \
        "CMake Error at x.txt:3 (message): CUDA::cublas was not found -- done"
    log.write_text("[1/2] nvcc a.cu\na.cu(3): error: identifier x is undefined\nninja: stop\n")
    assert build.first_error(log) == "a.cu(3): error: identifier x is undefined"


def test_build_failure_and_wait(home, monkeypatch, capsys):
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.build(arch="90a", progress=lambda _: None) == 1
    assert "cmake is not on PATH" in capsys.readouterr().err
    assert paths.read_state()["status"] == "failed"
    assert build.wait(1) == 1
    build._write_state(status="building", pid=2 ** 22 + 12345, arch="90a")   # no such process
    assert build.wait(1) == 1 and "ended without finishing" in capsys.readouterr().err
    build._write_state(status="built", arch="90a", cuda=True)
    assert build.wait(1) == 0
    assert not build.is_built("90a")                     # the state alone is not a build


def test_reuses_a_finished_build(home):
    paths.bin_dir().mkdir(parents=True)
    for tool in paths.TOOLS:
        (paths.bin_dir() / tool).write_text("#!/bin/sh\n")
        (paths.bin_dir() / tool).chmod(0o755)
    build._write_state(status="built", arch="90a", cuda=True)
    messages = []
    assert build.build(arch="90a", progress=messages.append) == 0
    assert messages and "already built" in messages[0]
    assert not build.is_built("86")


LLAMA_BENCH = "\n".join(json.dumps(row) for row in (
    {"n_prompt": 512, "n_gen": 0, "avg_ts": 30412.345, "stddev_ts": 120.0},
    {"n_prompt": 2048, "n_gen": 0, "avg_ts": 33901.0, "stddev_ts": 80.0},
    {"n_prompt": 0, "n_gen": 128, "avg_ts": 960.456, "stddev_ts": 3.21}))
BATCHED = "main: n_kv_max = 8448\n" + "\n".join(json.dumps(row) for row in (
    {"pp": 128, "tg": 128, "pl": 8, "speed_tg": 2807.44, "speed": 1.0},
    {"pp": 128, "tg": 128, "pl": 32, "speed_tg": 4224.09, "speed": 1.0}))


def test_tool_output_parsing():
    assert bench.parse_bench("noise\n" + LLAMA_BENCH) == {
        "prefill512": 30412.3, "prefill2048": 33901.0, "decode_bs1": 960.46,
        "decode_bs1_stddev": 3.21}
    assert bench.parse_batched(BATCHED) == {"decode_bs8": 2807.4, "decode_bs32": 4224.1}


def test_bench_runs_the_tools_with_the_benchmark_flags(home, tmp_path, monkeypatch):
    paths.bin_dir().mkdir(parents=True)
    calls = []
    for tool, output in (("llama-bench", LLAMA_BENCH), ("llama-batched-bench", BATCHED)):
        script = paths.bin_dir() / tool
        dump = tmp_path / f"{tool}.args"
        script.write_text(f"#!{sys.executable}\nimport sys\n"
                          f"open({str(dump)!r}, 'w').write(' '.join(sys.argv[1:]))\n"
                          f"print({output!r})\n")
        script.chmod(0o755)
        calls.append(dump)
    monkeypatch.setattr(bench, "_smi", lambda query: [])
    figures = bench.bench(tmp_path / "m.gguf", batched=True, n_cpu_moe=4)
    assert figures["decode_bs1"] == 960.46 and figures["decode_bs32"] == 4224.1
    assert "errors" not in figures
    args = calls[0].read_text().split()
    for flag in ("-ngl 99", "-fa 1", "-r 3", "-p 512,2048", "-n 128", "-ncmoe 4", "-o jsonl"):
        assert flag in " ".join(args)
    assert "-npl 8,32" in calls[1].read_text() and "-fa on" in calls[1].read_text()


def _staged() -> Path | None:
    folder = paths.staged_dir()
    return folder if (folder / paths.SOURCES).is_file() else None


@pytest.mark.skipif(_staged() is None, reason="no staged llama.cpp sources "
                    "(python -m benchmarks.llama_cpp_cuda stage)")
def test_the_converter_writes_a_file_freetoken_loads(tmp_path, monkeypatch, reference_moe_ops):
    """llama.cpp's own converter on a random qwen3_moe folder, with the placeholder vocabulary;
    FreeToken reads the result and gives the folder's logits (bf16 rounding apart)."""
    import torch

    from benchmarks.llama_cpp_cuda.convert import convert
    from freetoken.models.loader import load_model
    from tests.models.helpers import PagedRunner, tiny_hf_model

    monkeypatch.setenv("LCPP_HOME", os.environ.get("LCPP_HOME") or str(tmp_path / "home"))
    folder = tmp_path / "hf"
    folder.mkdir()
    tiny_hf_model("qwen3_moe", folder, hidden_size=256, head_dim=64, vocab_size=512,
                  moe_intermediate_size=256)
    gguf = convert(folder, tmp_path / "m.gguf", "bf16", _staged())
    ours, reference = load_model(str(gguf)), load_model(str(folder))
    assert ours.config.vocab_size == 512 and ours.config.moe == reference.config.moe
    chunk = [(0, [5, 6, 7, 300])]
    a, b = PagedRunner(ours.model).step(chunk), PagedRunner(reference.model).step(chunk)
    assert torch.isfinite(a).all()
    assert (a - b).abs().max() < 0.02 * b.abs().max()


def test_vram_peak_reads_the_process_figure(monkeypatch):
    def smi(query):
        if "compute-apps" in query:
            return [f"{watcher.pid}, 1536", "1, 99"]
        return ["4000"]

    monkeypatch.setattr(bench, "_smi", smi)
    watcher = bench.VramPeak()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    watcher.watch(proc)
    proc.wait()
    assert watcher.stop() == 1536 and watcher.source == "the process's own"


def test_a_background_build_is_waited_for(home, tmp_path):
    """`build --background` returns at once with the state already "building"; `wait` follows
    the detached build to its end (here a failure: no staged sources)."""
    message = build.start_background(tmp_path / "nowhere", "90a")
    assert "started in the background" in message
    assert paths.read_state()["status"] in ("building", "failed")
    assert build.wait(60, poll=0.2) == 1
    state = paths.read_state()
    assert state["status"] == "failed" and "no staged llama.cpp sources" in state["error"]
    assert "no staged llama.cpp sources" in (home / "build.out").read_text()
