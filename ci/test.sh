#!/usr/bin/env bash
# Set up a venv from scratch, build and install the kernel cache, run the whole test suite
# with JIT disabled (every kernel must come from the cache; JIT tests opt back in themselves).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test]" setuptools wheel

# The cache wheel for every target whose compiler is here (CPU always; CUDA with nvcc;
# ROCm with clang >= 17). Built once; the tests reuse it.
[ -n "${CUDA_HOME:-}" ] || { [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda; } || true
rm -rf build/cache-wheel && mkdir -p build/cache-wheel
echo "building the kernel cache (targets: ${FREETOKEN_CACHE_TARGETS:-every available})" >&2
start=$(date +%s)
"$VENV/bin/python" -m pip wheel --no-deps --no-build-isolation -q -w build/cache-wheel ./kernel-cache
echo "kernel cache built in $(( $(date +%s) - start )) s" >&2
WHEEL=$(ls build/cache-wheel/*.whl)
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$WHEEL"

export FREETOKEN_DISABLE_JIT=1 FREETOKEN_TEST_CACHE_WHEEL="$PWD/$WHEEL"
# the slowest tests close the log: what to look at when the run nears its time budget
exec "$VENV/bin/python" -m pytest -q -rs --durations=25 "$@"
