"""`build`: llama.cpp's CUDA tools (paths.TOOLS) from the staged sources, into $LCPP_HOME.

Static binaries, one CUDA architecture (the GPU's, from nvidia-smi: 9.0 -> 90a; CUDA_ARCH
overrides; 90a without a GPU), no OpenSSL (no downloads), no web UI, no tests. A finished build
for the same architecture is reused. Progress goes to stdout (a line every 5%), the compiler's
output to $LCPP_HOME/cmake.log and build.log; $LCPP_HOME/build.json holds the state, which
`wait` and the benchmarks read. About 7-8 minutes on 16 cores: start it in the background at the
top of a GPU call (`build --background`, a new session that outlives the command) and measure
FreeToken meanwhile.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.llama_cpp_cuda import paths

_PROGRESS = (re.compile(r"^\[\s*(\d+)/(\d+)\]"), re.compile(r"^\[\s*(\d+)%\]"))
_ERRORS = (re.compile(r"^CMake Error"), re.compile(r"\berror\b", re.IGNORECASE),
           re.compile(r"fatal", re.IGNORECASE))


def gpu_arch() -> str:
    """CUDA_ARCH, else the first GPU's compute capability (sm_90 as 90a, the Hopper features
    llama.cpp's kernels use), else 90a."""
    if os.environ.get("CUDA_ARCH"):
        return os.environ["CUDA_ARCH"]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    if not out or not re.fullmatch(r"\d+\.\d+", out[0]):
        return "90a"
    major, minor = out[0].split(".")
    arch = f"{major}{minor}"
    return arch + "a" if arch == "90" else arch


def configure_command(src: Path, build: Path, arch: str, cuda: bool = True) -> list[str]:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(src), "-B", str(build), *generator,
            "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
            f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF"]


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "-j", str(jobs), "--target", *paths.TOOLS]


def is_built(arch: str, cuda: bool = True) -> bool:
    state = paths.read_state()
    return (state.get("status") == "built" and state.get("arch") == arch
            and state.get("cuda", True) == cuda
            and all(os.access(paths.bin_dir() / t, os.X_OK) for t in paths.TOOLS))


def _write_state(**state) -> None:
    paths.home().mkdir(parents=True, exist_ok=True)
    tmp = paths.state_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(paths.state_path())


def first_error(log: Path) -> str:
    """The first error `log` names (CMake's with the lines of its message, else a compiler's
    or a fatal one; else the last line), as one line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"no log at {log}"
    lines = [ln for ln in lines if "not a git repository" not in ln]   # build-info, harmless
    for pattern in _ERRORS:
        for i, line in enumerate(lines):
            if pattern.search(line):
                text = " ".join(lines[i:i + 4]) if line.startswith("CMake Error") else line
                return text[:300]
    return (lines[-1] if lines else "empty log")[:300]


def _run_logged(command: list[str], log: Path, progress) -> int:
    """Run `command` with its output in `log`, reporting build progress every 5%."""
    start, shown = time.monotonic(), -5
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        for line in proc.stdout:
            out.write(line)
            for pattern in _PROGRESS:
                m = pattern.match(line)
                if m is None:
                    continue
                pct = (100 * int(m.group(1)) // max(int(m.group(2)), 1) if m.lastindex == 2
                       else int(m.group(1)))
                if pct >= shown + 5:
                    shown = pct - pct % 5
                    progress(f"llama.cpp build: {pct}% ({time.monotonic() - start:.0f} s)")
        return proc.wait()


def build(peer: Path | None = None, arch: str | None = None, jobs: int | None = None,
          cuda: bool = True, progress=print) -> int:
    """Build (or reuse) the tools; 0 on success, 1 with a one-line error printed."""
    arch = arch or gpu_arch()
    if is_built(arch, cuda):
        progress(f"llama.cpp already built for {arch} in {paths.bin_dir()}")
        return 0
    state = paths.read_state()
    if state.get("status") == "building" and state.get("pid") != os.getpid() \
            and _alive(state.get("pid")):
        progress(f"llama.cpp is being built by pid {state['pid']}: waiting for it")
        return wait(3600, progress)
    started = time.strftime("%H:%M:%S")
    _write_state(status="building", pid=os.getpid(), arch=arch, cuda=cuda, started=started)
    t0 = time.monotonic()

    def fail(step: str, log: Path | None, why: str | None = None) -> int:
        error = f"{step}: {why or first_error(log)}" + (f" (log: {log})" if log else "")
        _write_state(status="failed", arch=arch, cuda=cuda, started=started, error=error)
        print(f"error: llama.cpp build failed at {error}", file=sys.stderr, flush=True)
        return 1

    if shutil.which("cmake") is None:
        return fail("setup", None, "cmake is not on PATH")
    try:
        src = paths.sources(peer)
    except paths.PeerUnavailable as exc:
        return fail("sources", None, str(exc))
    target = paths.home() / "build"
    if _generator(target) not in (None, "Ninja" if shutil.which("ninja") else "Unix Makefiles"):
        shutil.rmtree(target)    # configured by another generator: CMake refuses to switch
    progress(f"llama.cpp build: configuring for sm_{arch} (CUDA {'on' if cuda else 'off'})")
    if _run_logged(configure_command(src, target, arch, cuda), paths.home() / "cmake.log",
                   progress):
        return fail("cmake configure", paths.home() / "cmake.log")
    jobs = jobs or int(os.environ.get("JOBS") or os.cpu_count() or 1)
    if _run_logged(build_command(target, jobs), paths.home() / "build.log", progress):
        return fail("cmake --build", paths.home() / "build.log")
    missing = [t for t in paths.TOOLS if not os.access(paths.bin_dir() / t, os.X_OK)]
    if missing:
        return fail("install", None, f"built, but {', '.join(missing)} missing in "
                                     f"{paths.bin_dir()}")
    seconds = round(time.monotonic() - t0)
    _write_state(status="built", arch=arch, cuda=cuda, started=started, seconds=seconds)
    progress(f"llama.cpp built for sm_{arch} in {seconds} s: {paths.bin_dir()}")
    return 0


def start_background(peer: Path | None = None, arch: str | None = None,
                     cuda: bool = True) -> str:
    """Start `build` in a new session (it outlives the calling command); what happened."""
    arch = arch or gpu_arch()
    if is_built(arch, cuda):
        return f"llama.cpp already built for {arch} in {paths.bin_dir()}"
    state = paths.read_state()
    log = paths.home() / "build.out"
    if state.get("status") == "building" and _alive(state.get("pid")):
        return f"llama.cpp build already running (pid {state['pid']}); log {log}"
    paths.home().mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "benchmarks.llama_cpp_cuda", "build", "--arch", arch]
    command += (["--peer", str(peer)] if peer else []) + ([] if cuda else ["--cpu-only"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(paths.REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=paths.REPO, env=env,
                                start_new_session=True)
    # the state says "building" before this returns, so a `wait` right after it waits
    _write_state(status="building", pid=proc.pid, arch=arch, cuda=cuda,
                 started=time.strftime("%H:%M:%S"))
    return f"llama.cpp build started in the background (pid {proc.pid}); log {log}"


def wait(timeout: float, progress=print, poll: float = 5.0) -> int:
    """Block until the build is done (0) or failed, or `timeout` seconds pass (1); a line of
    progress a minute."""
    start = time.monotonic()
    deadline, shown = start + timeout, start
    while True:
        state = paths.read_state()
        if state.get("status") == "built":
            return 0
        if state.get("status") == "failed":
            print(f"error: llama.cpp build failed at {state.get('error')}", file=sys.stderr)
            return 1
        if state.get("status") == "building" and not _alive(state.get("pid")):
            print(f"error: the llama.cpp build (pid {state.get('pid')}) ended without finishing; "
                  f"see {paths.home() / 'build.log'}", file=sys.stderr)
            return 1
        if not state:
            print(f"error: no llama.cpp build was started in {paths.home()}", file=sys.stderr)
            return 1
        if time.monotonic() > deadline:
            print(f"error: the llama.cpp build is still running after {timeout:.0f} s",
                  file=sys.stderr)
            return 1
        if time.monotonic() - shown >= 60:
            shown = time.monotonic()
            progress(f"waiting for the llama.cpp build ({shown - start:.0f} s so far; "
                     f"{paths.home() / 'build.out'})")
        time.sleep(poll)


def _generator(build: Path) -> str | None:
    """The CMake generator a build folder was configured with, None when unconfigured."""
    try:
        cache = (build / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"^CMAKE_GENERATOR:INTERNAL=(.*)$", cache, re.MULTILINE)
    return m.group(1).strip() if m else None


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
