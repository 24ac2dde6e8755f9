"""llama.cpp's CUDA build as a benchmark peer, from this repository alone.

    python -m benchmarks.llama_cpp_cuda stage [DEST]           # where PyPI is reachable
    python -m benchmarks.llama_cpp_cuda build [--background]   # on the GPU machine
    python -m benchmarks.llama_cpp_cuda wait [--timeout S]
    python -m benchmarks.llama_cpp_cuda convert HF_DIR OUT.gguf [bf16|f16|q8_0]
    python -m benchmarks.llama_cpp_cuda quantize IN.gguf OUT.gguf TYPE
    python -m benchmarks.llama_cpp_cuda bench FILE.gguf [--batched] [--n-cpu-moe N] [--vram]

DEST (default <repo>/.carry/llama-cpp, git-ignored) is the folder a GPU call carries; every other
verb takes --peer DIR to name it. Builds and unpacked sources live in $LCPP_HOME (default
~/llama.cpp-peer). A typical GPU call:

    python -m benchmarks.llama_cpp_cuda build --background   # ~7-8 min on 16 cores
    ... measure FreeToken meanwhile ...
    python -m benchmarks.llama_cpp_cuda wait && python benchmarks/gpu_vs_llamacpp.py ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):      # run as a file: make `benchmarks` importable
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from benchmarks.llama_cpp_cuda import paths  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp_cuda",
                                description=__doc__.split("\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("stage", help="pack llama.cpp's sources from the sdist into DEST")
    s.add_argument("dest", type=Path, nargs="?", default=None)
    s.add_argument("--version", default=paths.VERSION, help="llama-cpp-python sdist version")
    s.add_argument("--sdist", type=Path, default=None, help="an sdist already downloaded")
    b = verbs.add_parser("build", help="build the CUDA tools into $LCPP_HOME (reused if built)")
    b.add_argument("--arch", default=None, help="CUDA architecture (default: the GPU's, or 90a)")
    b.add_argument("--jobs", type=int, default=None)
    b.add_argument("--cpu-only", action="store_true", help="GGML_CUDA=OFF (no GPU kernels)")
    b.add_argument("--background", action="store_true",
                   help="start the build in a new session and return at once")
    w = verbs.add_parser("wait", help="block until a started build is done")
    w.add_argument("--timeout", type=float, default=1200)
    c = verbs.add_parser("convert", help="HF folder -> GGUF by llama.cpp's converter")
    c.add_argument("hf_dir", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("outtype", nargs="?", default="bf16", choices=["bf16", "f16", "q8_0"])
    q = verbs.add_parser("quantize", help="llama-quantize IN OUT TYPE")
    q.add_argument("src", type=Path)
    q.add_argument("out", type=Path)
    q.add_argument("qtype")
    r = verbs.add_parser("bench", help="llama-bench (+ llama-batched-bench) on one file, as JSON")
    r.add_argument("model", type=Path)
    r.add_argument("--batched", action="store_true")
    r.add_argument("--n-cpu-moe", type=int, default=0)
    r.add_argument("--threads", type=int, default=0)
    r.add_argument("--vram", action="store_true", help="sample each tool's peak GPU memory")
    for sub in (b, c):
        sub.add_argument("--peer", type=Path, default=None,
                         help=f"the staged folder (default {paths.staged_dir()})")
    return p


def main() -> int:
    args = _parser().parse_args()
    try:
        if args.verb == "stage":
            from benchmarks.llama_cpp_cuda.stage import stage

            dest = paths.staged_dir(args.dest)
            manifest = stage(dest, args.version, args.sdist)
            print(f"staged llama.cpp of {manifest['sdist']} in {dest} "
                  f"({manifest['bytes'] / 1e6:.1f} MB, {manifest['files']} files)")
        elif args.verb == "build":
            from benchmarks.llama_cpp_cuda import build

            if args.background:
                print(build.start_background(args.peer, args.arch, not args.cpu_only))
                return 0
            return build.build(args.peer, args.arch, args.jobs, cuda=not args.cpu_only)
        elif args.verb == "wait":
            from benchmarks.llama_cpp_cuda import build

            return build.wait(args.timeout)
        elif args.verb == "convert":
            from benchmarks.llama_cpp_cuda.convert import convert

            print(convert(args.hf_dir, args.out, args.outtype, args.peer))
        elif args.verb == "quantize":
            from benchmarks.llama_cpp_cuda.convert import quantize

            print(quantize(args.src, args.out, args.qtype))
        else:
            from benchmarks.llama_cpp_cuda.bench import bench

            print(json.dumps(bench(args.model, args.batched, args.n_cpu_moe, args.threads,
                                   args.vram)))
    except (paths.PeerUnavailable, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
