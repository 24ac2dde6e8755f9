#!/usr/bin/env bash
# Build the nightly pair from HEAD: the runtime wheel (py3-none-any) and the kernel-cache wheel,
# both stamped +g<sha9>, plus OUT/engine-linux_x86_64.json. The build runs in an export of the
# commit in a temp folder, so stamping never touches this checkout, even if the build is killed.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
ALLOW_DIRTY=0
BASE_URL=
BUILDER=pip
OUT=

usage() {
  cat <<EOF
usage: ci/nightly.sh [--allow-dirty] [--base-url URL] [--builder pip|cibuildwheel] OUT

Build freetoken + freetoken-kernel-cache stamped with the HEAD commit into OUT, and write
OUT/engine-linux_x86_64.json (schema 1: name, url, sha256 and size of each wheel).

  --allow-dirty    build the working tree as it is (tracked and untracked, not ignored files);
                   the stamp gets a '.dirty' part. Without it a modified tree is refused.
  --base-url URL   prefix of each wheel url in the manifest, where OUT will be published
                   (default: <release location>/nightly-<sha9>/, the release location being
                   FREETOKEN_RELEASE_URL or the default named in runtime/freetoken/env.py)
  --builder B      pip (default): build the cache here with 'pip wheel';
                   cibuildwheel: build it in the manylinux_2_28 + CUDA 13 container
                   (ci/cibuildwheel.toml; needs docker or podman)
  -h, --help       show this help

Environment: FREETOKEN_CACHE_TARGETS (cache targets: names or cpu/cuda/rocm/all; default every
target whose compiler is present), CUDA_HOME (the CUDA 13 toolkit for CUDA targets), PYTHON
(interpreter with setuptools, wheel, apache-tvm-ffi and ninja; default python3).
EOF
}

die() { echo "error: $*" >&2; exit 1; }
say() { echo "[nightly] $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --allow-dirty) ALLOW_DIRTY=1; shift ;;
    --base-url) [ $# -ge 2 ] || die "--base-url needs a URL"; BASE_URL=$2; shift 2 ;;
    --base-url=*) BASE_URL=${1#*=}; shift ;;
    --builder) [ $# -ge 2 ] || die "--builder needs pip or cibuildwheel"; BUILDER=$2; shift 2 ;;
    --builder=*) BUILDER=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; echo "error: unknown option '$1'" >&2; exit 2 ;;
    *) [ -z "$OUT" ] || { usage >&2; echo "error: one OUT folder only" >&2; exit 2; }; OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { usage >&2; echo "error: give the OUT folder for the wheels" >&2; exit 2; }
case "$BUILDER" in pip|cibuildwheel) ;; *) die "--builder must be pip or cibuildwheel, not '$BUILDER'" ;; esac
command -v "$PY" >/dev/null 2>&1 || die "'$PY' not found: set PYTHON to an interpreter with setuptools, wheel and apache-tvm-ffi"

git -C "$REPO" rev-parse --verify -q HEAD >/dev/null \
  || die "$REPO has no commit to build: commit first (the stamp is the commit sha)"
SHA=$(git -C "$REPO" rev-parse HEAD | cut -c1-9)
STAMP="g$SHA"
DIRTY=$(git -C "$REPO" status --porcelain --untracked-files=normal)
if [ -n "$DIRTY" ]; then
  [ "$ALLOW_DIRTY" = 1 ] || die "the working tree has uncommitted changes; commit them, or pass --allow-dirty to build the tree as it is:
$(echo "$DIRTY" | head -n 10)"
  STAMP="$STAMP.dirty"
fi

if [ -z "$BASE_URL" ]; then
  RELEASE=$("$PY" "$REPO/ci/release_url.py") || die "no release location (see above)"
  BASE_URL="$RELEASE/nightly-$SHA/"
fi

mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/freetoken-nightly.XXXXXX")
CHILD=

cleanup() {
  if [ -n "$CHILD" ]; then  # the build step's whole process group: pip, ninja, compilers
    kill -TERM -- "-$CHILD" 2>/dev/null || true
    wait "$CHILD" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# NOTE: bash runs traps only after a foreground child ends, so long steps run as background
# jobs (`wait` returns at once on a signal). `set -m` gives each job its own process group,
# which cleanup kills whole.
run_in() {  # run_in DIR COMMAND...
  local dir=$1 rc=0
  shift
  set -m
  (cd "$dir" && exec "$@") &
  CHILD=$!
  set +m
  wait "$CHILD" || rc=$?
  CHILD=
  return "$rc"
}

export_tree() {
  mkdir -p "$WORK/src"
  if [ -z "$DIRTY" ]; then
    git -C "$REPO" archive --format=tar HEAD | tar -x -C "$WORK/src"
  else  # the working tree: tracked and untracked files, minus ignored and deleted ones
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
      | tar --null -T - -cf -) | tar -x -C "$WORK/src"
  fi
}

stamp_version() {  # __version__ = "X" -> "X+<stamp>" (or "X.<stamp>" when X has a local part)
  "$PY" - "$WORK/src/runtime/freetoken/__init__.py" "$STAMP" <<'EOF'
import re, sys
path, stamp = sys.argv[1], sys.argv[2]
text = open(path).read()
pattern = r'__version__ = "([^"+]+)(\+[^"]*)?"'
match = re.search(pattern, text)
if not match or len(re.findall(pattern, text)) != 1:
    sys.exit(f"error: {path} must hold exactly one line __version__ = \"X.Y.Z\"")
version = match.group(1) + (match.group(2) + "." if match.group(2) else "+") + stamp
open(path, "w").write(text[:match.start()] + f'__version__ = "{version}"' + text[match.end():])
print(version)
EOF
}

build_wheels() {
  mkdir -p "$WORK/dist"
  say "runtime wheel"
  run_in "$WORK/src" "$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$WORK/dist" . \
    || die "the runtime wheel did not build (see above); PYTHON=$PY needs setuptools and wheel"
  say "kernel-cache wheel (targets: ${FREETOKEN_CACHE_TARGETS:-every target with a compiler}, builder: $BUILDER)"
  if [ "$BUILDER" = pip ]; then
    run_in "$WORK/src" "$PY" -m pip wheel --no-deps --no-build-isolation -q -w "$WORK/dist" ./kernel-cache \
      || die "the kernel-cache wheel did not build (see above); PYTHON=$PY needs apache-tvm-ffi and ninja, CUDA targets need CUDA_HOME"
  else
    command -v cibuildwheel >/dev/null 2>&1 || die "cibuildwheel not found: pip install cibuildwheel (and docker or podman)"
    export FREETOKEN_CACHE_TARGETS=${FREETOKEN_CACHE_TARGETS:-all}  # the container has every compiler
    run_in "$WORK/src" cibuildwheel --platform linux --config-file ci/cibuildwheel.toml \
      --output-dir "$WORK/dist" kernel-cache || die "cibuildwheel failed (see above)"
  fi
}

say "building $SHA from $REPO in $WORK"
export_tree
VERSION=$(stamp_version)
say "version $VERSION"
build_wheels
shopt -s nullglob
RUNTIME=("$WORK"/dist/freetoken-*.whl)
CACHE=("$WORK"/dist/freetoken_kernel_cache-*.whl)
if [ "${#RUNTIME[@]}" -ne 1 ] || [ "${#CACHE[@]}" -ne 1 ]; then
  die "expected one runtime and one kernel-cache wheel in $WORK/dist, found: $(ls "$WORK/dist")"
fi

# Copy under temporary names, then rename: OUT never holds a half-written wheel.
for wheel in "${RUNTIME[0]}" "${CACHE[0]}"; do
  cp "$wheel" "$OUT/.$(basename "$wheel").partial"
  mv -f "$OUT/.$(basename "$wheel").partial" "$OUT/$(basename "$wheel")"
done
"$PY" "$REPO/ci/write_manifest.py" --runtime "$OUT/$(basename "${RUNTIME[0]}")" \
  --kernel-cache "$OUT/$(basename "${CACHE[0]}")" --commit "$SHA" --base-url "$BASE_URL" \
  --out "$OUT/engine-linux_x86_64.json" >/dev/null
say "wrote $OUT/engine-linux_x86_64.json (wheels expected at $BASE_URL):"
say "  $(basename "${RUNTIME[0]}")"
say "  $(basename "${CACHE[0]}")"
