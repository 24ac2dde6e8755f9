"""Download the wheel pair a manifest pins and verify it; print the two wheel paths.

    python3 ci/fetch_pair.py --manifest PATH|URL --dest DIR

Stdlib only: ci/fetch-nightly-pair.sh runs it before any venv exists. Everything is checked
(manifest fields, names, size, sha256, stamps, the version inside each wheel) before the
caller installs anything. Exit 1 with `error: ...` on stderr when the pair must not be installed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wheel_pair  # noqa: E402  (a sibling script, not a package)
from wheel_pair import PairError  # noqa: E402

TIMEOUT_S = 60
WHEELS = ("runtime", "kernel_cache")


def is_url(source: str) -> bool:
    return urllib.parse.urlsplit(source).scheme in ("http", "https", "file")


def open_source(source: str):
    """A binary file object for a URL or a local path, with a clear error when unreachable."""
    try:
        if not is_url(source):
            return open(source, "rb")
        return urllib.request.urlopen(source, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise PairError(f"cannot download {source}: HTTP {exc.code} {exc.reason}; check the url "
                        "in the manifest and that the release is published") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", None) or exc
        if is_url(source):
            raise PairError(f"cannot reach {source} ({reason}): the release location is "
                            "unreachable from here; fix: --manifest PATH|URL with a manifest "
                            "whose wheels you can reach (ci/nightly.sh OUT writes one)") from None
        raise PairError(f"cannot read {source}: {reason}; check the path") from None


def copy_limited(source: str, path: Path, limit: int) -> int:
    """Copy source to path; stop one byte past `limit` (a bigger file is wrong anyway)."""
    written = 0
    try:
        with open_source(source) as src, open(path, "wb") as out:
            while written <= limit:
                chunk = src.read(min(1 << 20, limit + 1 - written))
                if not chunk:
                    break
                out.write(chunk)
                written += len(chunk)
    except OSError as exc:
        raise PairError(f"download of {source} failed: {exc}; try again") from None
    return written


def resolve(base: str, url: str) -> str:
    """A wheel url relative to the manifest resolves against the manifest's own location."""
    if is_url(url):
        return url
    if is_url(base):
        return urllib.parse.urljoin(base, url)
    return str(Path(base).resolve().parent / url)  # an absolute path stays itself


def load_manifest(source: str) -> dict:
    try:
        with open_source(source) as f:
            manifest = json.loads(f.read())
    except ValueError as exc:
        raise PairError(f"manifest {source} is not valid JSON ({exc}); regenerate it with "
                        "ci/write_manifest.py") from None
    check_fields(manifest, source)
    return manifest


def check_fields(manifest: object, source: str) -> None:
    """The parts of ci/manifest.schema.json that installing depends on."""
    def bad(what: str) -> PairError:
        return PairError(f"manifest {source}: {what}; regenerate it with ci/nightly.sh")

    if not isinstance(manifest, dict):
        raise bad("not a JSON object")
    if manifest.get("schema") != wheel_pair.SCHEMA:
        raise bad(f"schema {manifest.get('schema')!r}, this script reads schema {wheel_pair.SCHEMA}")
    if manifest.get("platform") != wheel_pair.PLATFORM:
        raise bad(f"platform {manifest.get('platform')!r}, expected {wheel_pair.PLATFORM}")
    if not wheel_pair.COMMIT.fullmatch(str(manifest.get("commit", ""))):
        raise bad(f"commit {manifest.get('commit')!r} is not a git sha")
    for key in WHEELS:
        entry = manifest.get(key)
        if not isinstance(entry, dict):
            raise bad(f"no {key!r} entry")
        name, sha, size = entry.get("name"), entry.get("sha256"), entry.get("size")
        if not isinstance(name, str) or not wheel_pair.WHEEL_NAME.fullmatch(name):
            raise bad(f"{key}.name {name!r} is not a wheel file name")
        if not isinstance(entry.get("url"), str) or not entry["url"]:
            raise bad(f"{key}.url is missing")
        if not isinstance(sha, str) or not wheel_pair.SHA256.fullmatch(sha):
            raise bad(f"{key}.sha256 {sha!r} is not 64 lowercase hex digits")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise bad(f"{key}.size {size!r} is not a positive integer")


def check_host() -> None:
    system, machine = platform.system(), platform.machine()
    if (system, machine) != ("Linux", "x86_64"):
        raise PairError(f"this pair is for {wheel_pair.PLATFORM}; this machine is {system} "
                        f"{machine}: build the pair here with ci/nightly.sh")


def check_names(manifest: dict) -> tuple[str, str]:
    """Stamps from the names alone, so a mismatched pair is refused before any download."""
    r_version, c_version = wheel_pair.check_wheel_names(manifest["runtime"]["name"],
                                                        manifest["kernel_cache"]["name"])
    if manifest.get("version") != r_version:
        raise PairError(f"manifest version {manifest.get('version')!r} differs from its runtime "
                        f"wheel {r_version}; regenerate it with ci/write_manifest.py")
    wheel_pair.check_pair(r_version, c_version, manifest["commit"], manifest.get("cuda"))
    return r_version, c_version


def download(entry: dict, manifest_source: str, dest: Path) -> Path:
    """Fetch one wheel, then check its size, sha256 and the version written inside it."""
    url = resolve(manifest_source, entry["url"])
    print(f"downloading {url}", file=sys.stderr)
    name, fix = entry["name"], "download it again; if it persists the release is damaged"
    path = dest / name
    size = copy_limited(url, path, entry["size"])
    if size != entry["size"]:
        got = f"more than {entry['size']}" if size > entry["size"] else str(size)
        raise PairError(f"{name}: size {got} bytes, the manifest says {entry['size']}; {fix}")
    digest = wheel_pair.sha256_file(path)
    if digest != entry["sha256"]:
        raise PairError(f"{name}: sha256 {digest} does not match the manifest's "
                        f"{entry['sha256']}; {fix}")
    _, version, _ = wheel_pair.wheel_parts(name)
    if wheel_pair.metadata_version(path) != version:
        raise PairError(f"{name} holds version {wheel_pair.metadata_version(path)} inside; "
                        "the file was renamed: rebuild the pair with ci/nightly.sh")
    return path


def fetch(source: str, dest: Path) -> list[Path]:
    """Verified local paths of the runtime and kernel-cache wheels."""
    check_host()
    manifest = load_manifest(source)
    r_version, c_version = check_names(manifest)
    print(f"pair {r_version} + {c_version} (commit {manifest['commit']})", file=sys.stderr)
    return [download(manifest[key], source, dest) for key in WHEELS]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", required=True, help="manifest path or http(s)/file URL")
    parser.add_argument("--dest", type=Path, required=True, help="existing folder for the wheels")
    args = parser.parse_args(argv)
    try:
        paths = fetch(args.manifest, args.dest)
    except PairError as exc:
        print(f"error: {exc}; nothing was installed", file=sys.stderr)
        return 1
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
