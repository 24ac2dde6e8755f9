"""`convert HF_DIR OUT.gguf [bf16|f16|q8_0]` (llama.cpp's converter, placeholder vocabulary) and
`quantize IN OUT TYPE` (llama-quantize)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.llama_cpp_cuda import paths

OUTTYPES = ("bf16", "f16", "q8_0", "f32")


def convert(hf_dir: Path, out: Path, outtype: str = "bf16", peer: Path | None = None) -> Path:
    """Convert the HF folder with llama.cpp's own converter; PeerUnavailable (no staged
    sources) or RuntimeError (the converter failed, with the end of its output)."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    src = paths.sources(peer)
    hook = Path(__file__).with_name("converter_hook.py")
    run = subprocess.run([sys.executable, str(hook), str(src), str(hf_dir), str(out), outtype],
                         capture_output=True, text=True)
    if run.returncode or not out.is_file():
        out.unlink(missing_ok=True)
        tail = (run.stderr or run.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir} ({run.returncode}): "
                           + " | ".join(tail))
    return out


def quantize(src: Path, out: Path, qtype: str, threads: int | None = None) -> Path:
    """`llama-quantize src out qtype`; PeerUnavailable (no build) or RuntimeError."""
    command = [str(paths.tool("llama-quantize")), str(src), str(out), qtype]
    if threads:
        command.append(str(threads))
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode or not out.is_file():
        out.unlink(missing_ok=True)
        tail = (run.stderr or run.stdout).strip().splitlines()[-4:]
        raise RuntimeError(f"llama-quantize {qtype} failed on {src} ({run.returncode}): "
                           + " | ".join(tail))
    return out
