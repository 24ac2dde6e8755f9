"""`bench FILE [--batched] [--n-cpu-moe N] [--vram]`: llama.cpp's speed on one GGUF file, as JSON.

- llama-bench -ngl 99 -fa 1 -r 3 -p 512,2048 -n 128: decode tok/s at batch 1 (tg128, after a
  warm-up run of its own) and prefill tok/s of 512- and 2048-token prompts (pp512, pp2048);
- with --batched, llama-batched-bench -npp 128 -ntg 128 -npl 8,32: aggregate decode tok/s of 8
  and 32 sequences decoding together (its S_TG t/s);
- with vram, the peak GPU memory each tool used (nvidia-smi, sampled every 0.2 s: the process's
  own figure when the driver lists it, else the device's use above what it was before the tool
  started); off by default, so that no sampling runs beside a timed run.

--n-cpu-moe N keeps the experts of the first N layers in host memory, computed by the CPU
(llama.cpp's answer to models larger than VRAM). Keys: decode_bs1, decode_bs1_stddev,
prefill512, prefill2048, decode_bs8, decode_bs32, vram_mib (per tool, with vram), errors (per
tool, on failure).
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

from benchmarks.llama_cpp_cuda import paths

PREFILLS = (512, 2048)
BATCHES = (8, 32)
GEN = 128


def bench_command(model: Path, n_cpu_moe: int = 0, threads: int = 0, reps: int = 3) -> list[str]:
    command = [str(paths.tool("llama-bench")), "-m", str(model), "-ngl", "99", "-fa", "1",
               "-r", str(reps), "-p", ",".join(map(str, PREFILLS)), "-n", str(GEN),
               "-o", "jsonl"]
    if n_cpu_moe:
        command += ["-ncmoe", str(n_cpu_moe)]
    if threads:
        command += ["-t", str(threads)]
    return command


def batched_command(model: Path, n_cpu_moe: int = 0, prompt: int = 128) -> list[str]:
    context = max(BATCHES) * (prompt + GEN) + 256
    command = [str(paths.tool("llama-batched-bench")), "-m", str(model), "-ngl", "99",
               "-fa", "on", "-c", str(context), "-npp", str(prompt), "-ntg", str(GEN),
               "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl"]
    if n_cpu_moe:
        command += ["-ncmoe", str(n_cpu_moe)]
    return command


def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def parse_bench(text: str) -> dict:
    """llama-bench's jsonl rows -> {decode_bs1, decode_bs1_stddev, prefill<N>}."""
    out = {}
    for row in _json_lines(text):
        if "avg_ts" not in row:
            continue
        if row.get("n_gen"):
            out["decode_bs1"] = round(row["avg_ts"], 2)
            out["decode_bs1_stddev"] = round(row.get("stddev_ts", 0.0), 2)
        elif row.get("n_prompt"):
            out[f"prefill{row['n_prompt']}"] = round(row["avg_ts"], 1)
    return out


def parse_batched(text: str) -> dict:
    """llama-batched-bench's jsonl rows -> {decode_bs<B>: aggregate decode tok/s}."""
    return {f"decode_bs{row['pl']}": round(row["speed_tg"], 1)
            for row in _json_lines(text) if "speed_tg" in row and "pl" in row}


class VramPeak:
    """Peak GPU memory (MiB) of one process while it runs, from nvidia-smi."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._base = _device_used()
        self.pid: int | None = None
        self.source = "device use above the start"
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def watch(self, proc: subprocess.Popen) -> VramPeak:
        self.pid = proc.pid
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            own = _process_used(self.pid)
            if own is not None:
                self.source = "the process's own"
                self.peak = max(self.peak, own)
            elif self._base is not None and (used := _device_used()) is not None:
                self.peak = max(self.peak, used - self._base)

    def stop(self) -> int | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak or None


def _smi(query: str) -> list[str]:
    try:
        run = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in run.stdout.splitlines() if ln.strip()] if not run.returncode \
        else []


def _device_used() -> int | None:
    rows = _smi("--query-gpu=memory.used")
    return int(rows[0]) if rows and rows[0].isdigit() else None


def _process_used(pid: int | None) -> int | None:
    for row in _smi("--query-compute-apps=pid,used_memory"):
        cells = [c.strip() for c in row.split(",")]
        if len(cells) == 2 and cells[0] == str(pid) and cells[1].isdigit():
            return int(cells[1])
    return None


def run_tool(command: list[str], vram: bool = False) -> tuple[int, str, int | None]:
    """(exit status, stdout + stderr, peak VRAM MiB or None) of one tool run."""
    peak = VramPeak() if vram else None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if peak is not None:
        peak.watch(proc)
    out, err = proc.communicate()
    return proc.returncode, out + "\n" + err, peak.stop() if peak is not None else None


def bench(model: Path, batched: bool = False, n_cpu_moe: int = 0, threads: int = 0,
          vram: bool = False) -> dict:
    """llama.cpp's figures for `model` (see the module doc); PeerUnavailable without a build."""
    result: dict = {"model": str(model), "n_cpu_moe": n_cpu_moe, "vram_mib": {}, "errors": {}}
    jobs = [("llama-bench", bench_command(model, n_cpu_moe, threads), parse_bench)]
    if batched:
        jobs.append(("llama-batched-bench", batched_command(model, n_cpu_moe), parse_batched))
    for name, command, parse in jobs:
        code, text, peak = run_tool(command, vram)
        if vram:
            result["vram_mib"][name] = peak
        figures = parse(text)
        result.update(figures)
        if code or not figures:
            tail = [ln for ln in text.splitlines() if ln.strip()][-3:]
            result["errors"][name] = f"exit {code}: " + " | ".join(tail)
    if not result["errors"]:
        del result["errors"]
    return result
