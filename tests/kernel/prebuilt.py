"""The cache wheel under test's compiled objects (FREETOKEN_TEST_CACHE_WHEEL, set by
ci/test.sh), for build tests that would otherwise compile the same jobs again: the cache build
ran each job's build.compile_command (through ninja) and stored it at its key, so the wheel's
object is what that command makes."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

CACHE_ROOT = "freetoken_kernel_cache/cache"


def prebuilt_objects(jobs: list, scratch: Path) -> list[tuple[object, Path]] | None:
    """(job, its object extracted into `scratch`) for every build.BuildJob in `jobs`; None
    without a wheel under test or when it lacks any of them (the caller then compiles)."""
    wheel = os.environ.get("FREETOKEN_TEST_CACHE_WHEEL")
    if not wheel or not jobs:
        return None
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        if any(f"{CACHE_ROOT}/{job.output}" not in names for job in jobs):
            return None
        found = []
        for job in jobs:
            path = scratch / job.output
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(zf.read(f"{CACHE_ROOT}/{job.output}"))
            found.append((job, path))
    return found
