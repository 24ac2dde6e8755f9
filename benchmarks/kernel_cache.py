"""Kernel cache figures: load-from-cache vs cold JIT for every CPU kernel, build time per target,
wheel size.

    python benchmarks/kernel_cache.py [--targets cpu-x86_64,sm_90a,...] [--skip-build]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LOAD_ALL = """
import sys, time
from freetoken.csrc import build
from freetoken.kernel.loader import get_module, resolve
from freetoken.kernel.targets import device_spec
t = time.perf_counter()
names = [k.name for k in build.registry.KERNELS if k.cpu]
for name in names:
    get_module(name, "cpu")
print(f"{time.perf_counter() - t:.4f}")
print(",".join(resolve(n, device_spec("cpu")).source for n in names), file=sys.stderr)
"""


def build_wheel(targets: str, out: Path) -> tuple[float, Path]:
    """A cold build: a fresh object folder, so nothing is reused from earlier builds."""
    env = {**os.environ, "FREETOKEN_CACHE_TARGETS": targets,
           "FREETOKEN_BUILD_DIR": str(out / "objects")}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(REPO / "kernel-cache")], check=True, env=env)
    return time.perf_counter() - start, max(out.glob("*.whl"), key=os.path.getmtime)


def timed_load(env: dict) -> tuple[float, str]:
    done = subprocess.run([sys.executable, "-c", LOAD_ALL], env={**os.environ, **env},
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip()), done.stderr.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default="cpu-x86_64,sm_86,sm_89,sm_90a,sm_100f,sm_120,"
                                              "compute_120,gfx1151,gfx1201")
    parser.add_argument("--skip-build", action="store_true", help="only the load/JIT timing")
    parser.add_argument("--skip-load", action="store_true", help="only the per-target builds")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-bench-cache-"))
    rows = []
    if not args.skip_build:
        for target in args.targets.split(","):
            seconds, wheel = build_wheel(target, work / target)
            rows.append((target, seconds, wheel.stat().st_size))
            print(f"build {target:<12} {seconds:7.1f} s   wheel {wheel.stat().st_size / 1e6:6.2f} MB",
                  flush=True)
    if args.skip_load:
        return
    _, full = build_wheel("cpu-x86_64", work / "cpu")
    cache_dir = work / "unpacked"
    with zipfile.ZipFile(full) as zf:
        zf.extractall(cache_dir)
    cache = {"FREETOKEN_KERNEL_CACHE_DIR": str(cache_dir / "freetoken_kernel_cache" / "cache"),
             "FREETOKEN_DISABLE_JIT": "1", "FREETOKEN_JIT_DIR": str(work / "unused")}
    loads = sorted(timed_load(cache)[0] for _ in range(5))
    jit = {"FREETOKEN_DISABLE_KERNEL_CACHE": "1", "FREETOKEN_DISABLE_JIT": "0",
           "FREETOKEN_JIT_DIR": str(work / "jit")}
    cold, sources = timed_load(jit)
    assert set(sources.split(",")) == {"jit-cached"}, sources
    print(f"load every CPU kernel from the cache: {loads[2] * 1e3:.1f} ms (median of 5)")
    print(f"JIT-compile every CPU kernel cold:    {cold:.1f} s")
    print(f"ratio cold JIT / cache load:          {cold / loads[2]:.0f}x")
    if rows:
        print(f"sum of per-target build times: {sum(r[1] for r in rows):.0f} s on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
