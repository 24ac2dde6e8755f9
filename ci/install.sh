#!/usr/bin/env bash
# Install FreeToken for one user: a venv under FREETOKEN_HOME holding the wheel pair pinned by
# engine-manifest.json (precompiled kernels, no compiler needed), `ft` linked into ~/.local/bin,
# then `ft doctor`.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
HOME_DIR=${FREETOKEN_HOME:-$HOME/.freetoken}
BIN_DIR=${XDG_BIN_HOME:-$HOME/.local/bin}
MANIFEST="$HERE/../engine-manifest.json"
PY=${PYTHON:-python3}
YES=0

usage() {
  cat <<EOF
usage: ci/install.sh [--yes] [--manifest PATH|URL]

Install the pinned freetoken + freetoken-kernel-cache pair for this user:
  venv   \$FREETOKEN_HOME/venv   (FREETOKEN_HOME defaults to ~/.freetoken)
  link   ~/.local/bin/ft        (\$XDG_BIN_HOME when set)
then run 'ft doctor'. Running it again re-verifies the pair and keeps what is installed.

  --yes, -y            do not ask for confirmation (for scripts and CI)
  --manifest PATH|URL  install this manifest instead of engine-manifest.json
  -h, --help           show this help

PYTHON picks the interpreter for the venv (default python3, needs >= 3.10).
EOF
}

die() { echo "error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    -y|--yes) YES=1; shift ;;
    --manifest) [ $# -ge 2 ] || die "--manifest needs a path or URL"; MANIFEST=$2; shift 2 ;;
    --manifest=*) MANIFEST=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; echo "error: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

VENV="$HOME_DIR/venv"
command -v "$PY" >/dev/null 2>&1 || die "'$PY' not found: install Python >= 3.10 (or set PYTHON)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "$("$PY" -V 2>&1) is too old: FreeToken needs Python >= 3.10; set PYTHON to a newer one"
"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY cannot create venvs: install the venv module (Debian/Ubuntu: apt install python3-venv)"
if [ -e "$BIN_DIR/ft" ] && [ ! -L "$BIN_DIR/ft" ]; then
  die "$BIN_DIR/ft exists and is not a link this script made; move it away and run again"
fi

cat <<EOF
FreeToken will be installed:
  manifest  $MANIFEST
  venv      $VENV
  command   $BIN_DIR/ft
EOF
if [ "$YES" != 1 ]; then
  (exec </dev/tty) 2>/dev/null || die "no terminal to confirm on; run again with --yes"
  printf 'Continue? [y/N] ' >&2
  read -r answer </dev/tty || answer=
  case "$answer" in y|Y|yes|YES) ;; *) echo "nothing installed" >&2; exit 1 ;; esac
fi

mkdir -p "$HOME_DIR" "$BIN_DIR"
PYTHON="$PY" bash "$HERE/fetch-nightly-pair.sh" --manifest "$MANIFEST" --venv "$VENV"
[ -x "$VENV/bin/ft" ] || die "$VENV/bin/ft is missing after the install; rerun with a fresh FREETOKEN_HOME"
ln -sfn "$VENV/bin/ft" "$BIN_DIR/ft"
echo "linked $BIN_DIR/ft -> $VENV/bin/ft"

echo
echo "== ft doctor =="
doctor_rc=0
"$VENV/bin/ft" doctor || doctor_rc=$?
echo
if [ "$doctor_rc" != 0 ]; then
  echo "warning: FreeToken is installed, but ft doctor found the problems listed above; fix them, then run 'ft doctor' again" >&2
fi
case ":$PATH:" in
  *":$BIN_DIR:"*) ;;
  *) echo "note: $BIN_DIR is not on PATH; add it:  export PATH=\"$BIN_DIR:\$PATH\"" ;;
esac
echo "next: ft serve    # OpenAI- and Anthropic-compatible API on http://127.0.0.1:1919 (default model SmolLM2-135M-Instruct)"
