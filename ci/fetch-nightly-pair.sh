#!/usr/bin/env bash
# Download the runtime + kernel-cache wheel pair a manifest pins, verify it (size, sha256,
# matching build stamps) and install it into a venv. Nothing is installed unless every check
# passes; running it again is harmless.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MANIFEST="$HERE/../engine-manifest.json"
VENV=${VIRTUAL_ENV:-}
PY=${PYTHON:-python3}
DEPS=1

usage() {
  cat <<EOF
usage: ci/fetch-nightly-pair.sh [--manifest PATH|URL] [--venv DIR] [--no-deps]

Install the freetoken + freetoken-kernel-cache pair pinned by a manifest.

  --manifest PATH|URL  manifest to install (default: engine-manifest.json of this checkout);
                       wheel urls relative to it resolve against its location
  --venv DIR           venv to install into, created if missing (default: \$VIRTUAL_ENV)
  --no-deps            install only the two wheels (dependencies already present)
  -h, --help           show this help

Installs with 'uv pip install' when uv is on PATH, else with the venv's pip
(FREETOKEN_INSTALLER=pip forces pip). A torch already in the venv that satisfies the
runtime's requirement is kept. PYTHON picks the interpreter that creates the venv.
EOF
}

die() { echo "error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --manifest) [ $# -ge 2 ] || die "--manifest needs a path or URL"; MANIFEST=$2; shift 2 ;;
    --manifest=*) MANIFEST=${1#*=}; shift ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a folder"; VENV=$2; shift 2 ;;
    --venv=*) VENV=${1#*=}; shift ;;
    --no-deps) DEPS=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "error: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

[ -n "$VENV" ] || die "no venv to install into: pass --venv DIR (created if missing) or activate one"
command -v "$PY" >/dev/null 2>&1 || die "'$PY' not found: install Python >= 3.10 or set PYTHON"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/freetoken-fetch.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# Download and verify everything first: a refused pair leaves the venv untouched.
# fetch_pair.py's one `error:` line says why a pair is refused; nothing is installed then.
"$PY" "$HERE/fetch_pair.py" --manifest "$MANIFEST" --dest "$WORK" >"$WORK/wheels.txt" || exit 1
mapfile -t WHEELS <"$WORK/wheels.txt"
[ "${#WHEELS[@]}" -eq 2 ] || die "internal: expected two verified wheels, got ${#WHEELS[@]}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating venv $VENV" >&2
  "$PY" -m venv "$VENV" \
    || die "could not create a venv at $VENV with $PY (Debian/Ubuntu: apt install python3-venv)"
fi

install_with_uv() {
  local args=(pip install --python "$VENV/bin/python"
              --reinstall-package freetoken --reinstall-package freetoken-kernel-cache)
  [ "$DEPS" = 1 ] || args+=(--no-deps)
  "$UV" "${args[@]}" "${WHEELS[@]}"
}

install_with_pip() {
  local pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
  # First the wheels with their dependencies, then the same two files again, so a rebuilt pair
  # of the same version replaces the old files without touching the dependencies.
  if [ "$DEPS" = 1 ]; then "${pip[@]}" "${WHEELS[@]}"; fi
  "${pip[@]}" --no-deps --force-reinstall "${WHEELS[@]}"
}

UV=$(command -v uv || true)
if [ -n "$UV" ] && [ "${FREETOKEN_INSTALLER:-uv}" != pip ]; then
  install_with_uv || die "uv could not install the pair into $VENV (see above); check the network or run with --no-deps if the dependencies are already there"
else
  "$VENV/bin/python" -m pip --version >/dev/null 2>&1 \
    || die "neither uv nor pip is available for $VENV: install uv or recreate the venv with pip"
  install_with_pip || die "pip could not install the pair into $VENV (see above); check the network or run with --no-deps if the dependencies are already there"
fi
echo "installed $(basename "${WHEELS[0]}") and $(basename "${WHEELS[1]}") into $VENV" >&2
