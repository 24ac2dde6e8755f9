"""The cache wheel's platform tag is honest: no .so in it needs a newer glibc (or libstdc++) than
the manylinux tag promises. Symbol versions are read from each ELF file, cross-checked with
readelf, and with `auditwheel show` where it is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from freetoken.toolchain import elf_versions

TAG = "manylinux_2_28_x86_64"


@pytest.fixture(scope="module")
def wheel_objects(cache_wheel, tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("tag-check")
    with zipfile.ZipFile(cache_wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".so")]
        zf.extractall(out, names)
    assert names, f"{cache_wheel.name} holds no .so"
    return [out / n for n in names]


def test_wheel_is_tagged_manylinux_2_28(cache_wheel):
    assert cache_wheel.name.endswith(f"-py3-none-{TAG}.whl"), cache_wheel.name


def test_no_symbol_needs_more_than_the_tag(wheel_objects):
    problems = []
    for so in wheel_objects:
        needs = elf_versions.needed_versions(so)
        assert any(n.family == "GLIBC" for n in needs), f"{so.name}: no GLIBC needs were read"
        problems += [f"{so.parent.name}/{so.name}: {n.symbol}@{n.version} ({n.library})"
                     for n in elf_versions.too_new(needs)]
    assert not problems, "symbol versions newer than manylinux_2_28:\n" + "\n".join(problems)


def test_the_reader_agrees_with_readelf(wheel_objects):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    for so in wheel_objects:
        listing = subprocess.run([readelf, "--dyn-syms", "-W", str(so)], check=True,
                                 capture_output=True, text=True).stdout
        # Undefined symbols print as `name@VERSION (n)`; definitions carry `@@` or no version.
        theirs = set(re.findall(r" UND (\S+?)@([A-Z]+_[0-9.]+)", listing))
        ours = {(n.symbol, n.version) for n in elf_versions.needed_versions(so)}
        assert ours == theirs, (so.name, sorted(ours ^ theirs)[:10])


def test_the_reader_sees_a_too_new_symbol(tmp_path):
    """A library built here against a plain `pthread_join` needs GLIBC_2.34 on glibc >= 2.34:
    the check must flag such a file (it is what the compat layer exists to prevent)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "t.c"
    src.write_text("#include <pthread.h>\nint f(pthread_t t) { return pthread_join(t, 0); }\n")
    so = tmp_path / "t.so"
    subprocess.run([cc, "-shared", "-fPIC", "-x", "c", str(src), "-o", str(so), "-pthread"],
                   check=True)
    need = [n for n in elf_versions.needed_versions(so) if n.symbol == "pthread_join"]
    assert need and need[0].family == "GLIBC"
    libc = subprocess.run(["ldd", "--version"], capture_output=True, text=True).stdout
    if re.search(r"2\.(3[4-9]|[4-9]\d)\b", libc.splitlines()[0] if libc else ""):
        assert elf_versions.too_new(need), need


def test_auditwheel_agrees(cache_wheel):
    pytest.importorskip("auditwheel")
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(cache_wheel)],
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    text = " ".join(shown.stdout.split())
    # auditwheel reports the tag its symbol versions allow (libtvm_ffi.so, which pip installs
    # beside the runtime, is an external library it cannot judge, hence no full policy match).
    versions = re.findall(r"(GLIBC(?:XX)?_[0-9.]+)", text)
    assert versions, text
    for version in versions:
        need = elf_versions.Need("?", version, "?")
        assert not elf_versions.too_new([need]), (version, text)
    allowed = re.findall(r'constrains the platform tag to "manylinux_2_(\d+)_x86_64"', text)
    assert allowed and int(allowed[0]) <= 28, text
