#!/usr/bin/env bash
# Build llama.cpp's own llama-bench, llama-server and llama-lookup (prompt-lookup decoding) from
# the llama.cpp that llama-cpp-python
# vendors (its sdist), so benchmarks/cpu_serve.py measures the peer's native tools beside the
# Python binding: same llama.cpp, default CMake settings (GGML_NATIVE: this CPU's ISA).
# Built outside git; a few minutes on two cores. Exits 1 with one line when it cannot build.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
DEST=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/freetoken-bench/llama.cpp-$VERSION}
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}

die() { echo "error: llama-bench not built: $*" >&2; exit 1; }

if [ -x "$DEST/bin/llama-bench" ] && [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-lookup" ]; then
  echo "$DEST/bin"
  exit 0
fi
command -v cmake >/dev/null 2>&1 || die "cmake is not installed"
command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) on PATH"

mkdir -p "$DEST"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/llama-cpp-src.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

"$PY" -m pip download -q --no-deps --no-binary :all: --disable-pip-version-check \
  "llama-cpp-python==$VERSION" -d "$WORK" >&2 \
  || die "pip could not download the llama-cpp-python==$VERSION sdist"
SDIST=$(ls "$WORK"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1)
[ -n "$SDIST" ] || die "no llama_cpp_python-*.tar.gz in $WORK"
tar -xzf "$SDIST" -C "$WORK"
SRC=$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | head -n 1)
[ -n "$SRC" ] || die "the sdist holds no vendor/llama.cpp"

echo "building llama-bench, llama-server and llama-lookup from $(basename "$SDIST") into $DEST (-j $JOBS) ..." >&2
rm -rf "$DEST/build"   # its cache names the temporary source folder of an earlier build
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON >"$DEST/cmake.log" 2>&1 \
  || die "cmake configure failed (see $DEST/cmake.log)"
cmake --build "$DEST/build" --target llama-bench llama-server llama-lookup -j "$JOBS" >"$DEST/build.log" 2>&1 \
  || die "the build failed (see $DEST/build.log)"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-bench" "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-lookup" "$DEST/bin/"
echo "$DEST/bin"
