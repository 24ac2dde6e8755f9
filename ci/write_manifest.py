"""Write the manifest of a nightly wheel pair (schema 1, see ci/manifest.schema.json).

    python3 ci/write_manifest.py --runtime R.whl --kernel-cache C.whl --commit SHA9 \
        [--base-url URL] [--out OUT/engine-linux_x86_64.json]

Stdlib only. Refuses a pair whose stamps differ from the commit, so a manifest never pins a
pair that ci/fetch-nightly-pair.sh would refuse.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheel_pair  # noqa: E402  (a sibling script, not a package)

INDEX_MEMBER = f"{wheel_pair.CACHE_DIST}/cache/index.json"


def cache_cuda(cache_wheel: Path) -> str | None:
    """'13.0' when the cache wheel's index records a CUDA toolkit, else None."""
    try:
        with zipfile.ZipFile(cache_wheel) as zf:
            index = json.loads(zf.read(INDEX_MEMBER))
    except (KeyError, zipfile.BadZipFile, ValueError) as exc:
        raise wheel_pair.PairError(f"{cache_wheel.name} has no readable {INDEX_MEMBER} ({exc}); "
                                   "build it with the kernel-cache backend") from None
    toolkit = index.get("cuda")
    return ".".join(str(toolkit).split(".")[:2]) if toolkit else None


def wheel_entry(path: Path, base_url: str) -> dict:
    return {"name": path.name, "url": base_url + path.name,
            "sha256": wheel_pair.sha256_file(path), "size": path.stat().st_size}


def build_manifest(runtime: Path, cache: Path, commit: str, base_url: str = "",
                   published: str | None = None) -> dict:
    """The manifest dict for a built pair; raises PairError for a pair that does not match."""
    if not wheel_pair.COMMIT.fullmatch(commit):
        raise wheel_pair.PairError(f"commit {commit!r} is not a lowercase hex git sha")
    r_version, c_version = wheel_pair.check_wheel_names(runtime.name, cache.name)
    for path, version in ((runtime, r_version), (cache, c_version)):
        inside = wheel_pair.metadata_version(path)
        if inside != version:
            raise wheel_pair.PairError(f"{path.name} says version {inside} inside; rebuild it")
    cuda = cache_cuda(cache)
    wheel_pair.check_pair(r_version, c_version, commit, cuda)
    if base_url and not base_url.endswith("/"):
        base_url += "/"
    published = published or datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    return {
        "schema": wheel_pair.SCHEMA, "channel": "nightly", "platform": wheel_pair.PLATFORM,
        "version": r_version, "commit": commit, "published": published, "python": ">=3.10",
        "cuda": cuda,
        "runtime": wheel_entry(runtime, base_url),
        "kernel_cache": wheel_entry(cache, base_url),
    }


def write_json(manifest: dict, out: Path) -> None:
    """Write atomically: a reader never sees half a manifest."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", type=Path, required=True, help="the freetoken wheel")
    parser.add_argument("--kernel-cache", type=Path, required=True,
                        help="the freetoken_kernel_cache wheel")
    parser.add_argument("--commit", required=True, help="the 9-character commit both are stamped with")
    parser.add_argument("--base-url", default="",
                        help="prefix of each wheel's url (default: the bare file name, which "
                             "resolves next to the manifest)")
    parser.add_argument("--out", type=Path, help=f"manifest path (default: beside the runtime "
                                                   f"wheel, named {wheel_pair.MANIFEST_NAME})")
    args = parser.parse_args(argv)
    for path in (args.runtime, args.kernel_cache):
        if not path.is_file():
            print(f"error: {path} does not exist; build the pair with ci/nightly.sh", file=sys.stderr)
            return 1
    try:
        manifest = build_manifest(args.runtime, args.kernel_cache, args.commit, args.base_url)
    except wheel_pair.PairError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out = args.out or args.runtime.parent / wheel_pair.MANIFEST_NAME
    write_json(manifest, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
