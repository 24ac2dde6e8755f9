"""The quantized rows of gpu_vs_llamacpp.py: one shape in one weight format, both engines on the
same file where both read it, the ceiling of that file measured in the same run.

A row's name is its shape and format: `{qwen3-8b,qwen3-30b-a3b,qwen3.6-35b-a3b}-{q4km,q8_0,fp8,
nvfp4}`. GGUF rows (q4km, q8_0): the shape's random bf16 HF folder, converted by llama.cpp's
converter to bf16 GGUF and quantized by llama-quantize (Q4_K_M, Q8_0); FreeToken and llama.cpp
load that one file. FP8 / NVFP4 rows (benchmarks/scaled_folder.py) are FreeToken's alone. A
format FreeToken's loader refuses (its error names it) leaves its column saying so.

Ceiling = D2D copy bandwidth (measured at the start of the run) / (the file's bytes one batch-1
decode step reads, from its own tensor table (benchmarks/step_bytes.py) + the KV (and recurrent
state) of the measured context).

Files are made once in the work folder and reused by later calls (a bf16 GGUF only while a
later row of the same call still needs it); the HF folder a row was made from is deleted when no
later row of the call needs it, and a row's own file once every engine that reads it has
measured it in this call (unless --keep-files): the benchmark machine's disk holds a few rows.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

BASES = ("qwen3-8b", "qwen3-30b-a3b", "qwen3.6-35b-a3b")
FORMATS = {"q4km": "Q4_K_M", "q8_0": "Q8_0", "fp8": "fp8", "nvfp4": "nvfp4"}
GGUF_FORMATS = ("Q4_K_M", "Q8_0")


@dataclass(frozen=True)
class QuantRow:
    name: str
    base: str       # the bf16 shape it is made from (a key of gpu_vs_llamacpp's shapes)
    format: str     # Q4_K_M | Q8_0 | fp8 | nvfp4

    @property
    def is_gguf(self) -> bool:
        return self.format in GGUF_FORMATS

    def artifact(self, work: Path) -> Path:
        """The file (GGUF) or folder (FP8/NVFP4) both engines load."""
        return work / (f"{self.name}.gguf" if self.is_gguf else self.name)


ROWS = {f"{base}-{suffix}": QuantRow(f"{base}-{suffix}", base, fmt)
        for base in BASES for suffix, fmt in FORMATS.items()}


def needed_later(row: QuantRow, later: list[str], work: Path) -> tuple[bool, bool]:
    """(the base HF folder, its bf16 GGUF): still needed by a later row of this call?"""
    folder = gguf = False
    for name in later:
        other = ROWS.get(name)
        if name == row.base:
            folder = True
        elif other is not None and other.base == row.base and not other.artifact(work).exists():
            folder = True
            gguf = gguf or other.is_gguf
    return folder, gguf


# Rows whose file is written directly as llama-quantize's Q4_K_M blocks (write_gguf_moe.py:
# its per-tensor type rule, random zero-mean blocks), streaming: a 12-layer Qwen3-30B-A3B bf16
# folder, its bf16 GGUF and llama-quantize's pass would take minutes of the GPU machine.
DIRECT = {"qwen3-30b-a3b-q4km": ("qwen3-30b-a3b", 12)}


def _write_direct(row: QuantRow, target: Path) -> Path:
    """The file, and beside it the config.json keys the ceiling's KV arithmetic reads."""
    from dataclasses import replace

    from benchmarks import write_gguf_moe

    shape_name, layers = DIRECT[row.name]
    shape = replace(write_gguf_moe.SHAPES[shape_name], layers=layers)
    write_gguf_moe.write_q4_k_m(target, shape)
    config = {"num_hidden_layers": shape.layers, "hidden_size": shape.hidden,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
              "head_dim": shape.head_dim}
    (target.parent / f"{row.base}.config.json").write_text(json.dumps(config))
    return target


def make_artifact(row: QuantRow, work: Path, build_base: Callable[[str, Path], None],
                  later: list[str], peer: Path | None) -> Path | str:
    """The row's file or folder (made now unless already in `work`), or why it cannot be."""
    from benchmarks.llama_cpp_cuda import paths

    target = row.artifact(work)
    if target.exists():
        return target
    if row.name in DIRECT:
        return _write_direct(row, target)
    base = work / row.base
    if not (base / "config.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        build_base(row.base, base)
    shutil.copy(base / "config.json", work / f"{row.base}.config.json")
    keep_folder, keep_gguf = needed_later(row, later, work)
    try:
        if row.is_gguf:
            from benchmarks.llama_cpp_cuda.convert import convert, quantize

            bf16 = work / f"{row.base}.bf16.gguf"
            try:
                if not bf16.is_file():
                    convert(base, bf16, "bf16", peer)
                quantize(bf16, target, row.format)
            finally:
                if not keep_gguf:
                    bf16.unlink(missing_ok=True)
        else:
            from benchmarks.scaled_folder import write_scaled

            write_scaled(base, target, row.format)
    except (paths.PeerUnavailable, RuntimeError) as exc:
        return str(exc)
    finally:
        if not keep_folder:
            shutil.rmtree(base, ignore_errors=True)
    return target


def ceiling(row: QuantRow, artifact: Path, work: Path, bandwidth: float, context: int) -> dict:
    """{"ceiling_tok_s", "step_bytes", "weight_bytes", "by_type"} of the row's file."""
    from benchmarks.step_bytes import context_bytes, gguf_weight_bytes, safetensors_weight_bytes

    weights = gguf_weight_bytes(artifact) if row.is_gguf else safetensors_weight_bytes(artifact)
    config = json.loads((work / f"{row.base}.config.json").read_text())
    step = weights["weights"] + context_bytes(config, context)
    return {"ceiling_tok_s": bandwidth / step, "step_bytes": step,
            "weight_bytes": weights["weights"], "by_type": weights["by_type"]}


def freetoken_row(artifact: Path, gen: int, run: Callable[[str, int], dict]) -> dict:
    """FreeToken's figures, or {"skipped": the loader's refusal or the failure}: one row's
    failure (traceback on stderr) must not cost the run its other rows."""
    import traceback

    from freetoken.models.errors import ModelError

    try:
        return run(str(artifact), gen)
    except ModelError as exc:
        return {"skipped": f"FreeToken does not load this file: {exc}"}
    except Exception as exc:  # noqa: BLE001 (reported in the row, the run goes on)
        traceback.print_exc()
        _free_gpu()
        return {"skipped": f"FreeToken failed: {type(exc).__name__}: {exc}"}


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def llamacpp_row(artifact: Path) -> dict:
    """llama.cpp's figures (llama-bench, llama-batched-bench) on the row's file."""
    from benchmarks.llama_cpp_cuda import paths
    from benchmarks.llama_cpp_cuda.bench import bench

    try:
        figures = bench(artifact, batched=True)
    except paths.PeerUnavailable as exc:
        return {"skipped": str(exc)}
    if "decode_bs1" not in figures:
        return {"skipped": f"llama-bench failed: {figures.get('errors')}"}
    return figures


def measure_row(name: str, work: Path, args, bandwidth: float, entry: dict, later: list[str],
                build_base: Callable[[str, Path], None], run_freetoken: Callable,
                peer_reason: Callable[[], str | None]) -> None:
    """Fill `entry` with the row's ceiling and the asked engines' figures. `peer_reason`: why
    llama.cpp cannot run now (None when its build is ready)."""
    row = ROWS[name]
    if not row.is_gguf and "freetoken" not in args.engines:
        entry["llama.cpp"] = {"skipped": f"FreeToken-only row ({row.format} checkpoint)"}
        return
    if (row.is_gguf and row.name not in DIRECT and not row.artifact(work).exists()
            and (why := peer_reason())):
        artifact: Path | str = f"the row's file comes from llama-quantize: {why}"
    else:
        artifact = make_artifact(row, work, build_base, later, args.peer)
    if isinstance(artifact, str):
        for engine in args.engines:
            entry[engine] = {"skipped": artifact}
        return
    entry.update(ceiling(row, artifact, work, bandwidth, 128 + args.gen // 2),
                 bandwidth_Bps=bandwidth, file=str(artifact))
    if "freetoken" in args.engines:
        entry["freetoken"] = freetoken_row(artifact, args.gen, run_freetoken)
    if "llama.cpp" in args.engines:
        if not row.is_gguf:
            entry["llama.cpp"] = {"skipped": f"FreeToken-only row ({row.format} checkpoint)"}
        elif why := peer_reason():
            entry["llama.cpp"] = {"skipped": why}
        else:
            entry["llama.cpp"] = llamacpp_row(artifact)
    # the disk holds a few rows' files at most: a file every engine that reads it has measured
    # in this call is done (a temporary work folder is never reused)
    done = {"freetoken", "llama.cpp"} <= args.engines if row.is_gguf else \
        "freetoken" in args.engines
    if args.work is None or (done and not getattr(args, "keep_files", False)):
        if artifact.is_dir():
            shutil.rmtree(artifact, ignore_errors=True)
        else:
            artifact.unlink(missing_ok=True)
