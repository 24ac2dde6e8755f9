#!/usr/bin/env bash
# Driver-only proof on a CUDA machine: install a wheel pair (plus offline dependency wheels)
# into the Python environment that holds torch ($PYTHON, default python3), hide every
# compiler, disable JIT, then verify the kernels, run the GPU tests and serve a real
# completion on the GPU.
#
#   ci/gpu-proof.sh WHEEL_DIR [GGUF]      (WHEEL_DIR holds freetoken, freetoken_kernel_cache
#                                         and any dependency wheels the machine lacks)
set -euo pipefail
WHEELS=$(cd "${1:?usage: ci/gpu-proof.sh WHEEL_DIR [GGUF]}" && pwd)
GGUF=${2:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=$(command -v "${PYTHON:-python3}")
BIN=$(dirname "$PY")

"$PY" -m pip install -q --no-index --find-links "$WHEELS" \
  "$(ls "$WHEELS"/freetoken-*.whl)" "$(ls "$WHEELS"/freetoken_kernel_cache-*.whl)"

# Nothing that compiles is reachable from here on. With HIDE_TOOLKIT=1 (a disposable test
# machine) every nvcc on disk is renamed too, so not even a toolkit search can find one.
if [ "${HIDE_TOOLKIT:-}" = 1 ]; then
  for f in /usr/local/cuda*/bin/nvcc /usr/bin/nvcc; do
    [ -f "$f" ] && [ ! -L "$f" ] && mv "$f" "$f.hidden" && echo "hid $f"
  done
fi
PATH="$BIN:$(echo "$PATH" | tr ':' '\n' | grep -v -e cuda -e '^$' | paste -sd:)"
export PATH
unset CUDA_HOME CUDA_PATH CXX CC
export FREETOKEN_DISABLE_JIT=1 FREETOKEN_JIT_DIR=/tmp/ft-no-jit
for tool in nvcc; do
  if command -v "$tool" >/dev/null; then echo "error: $tool still on PATH" >&2; exit 1; fi
done
echo "== nvcc hidden: $(command -v nvcc || echo none); FREETOKEN_DISABLE_JIT=$FREETOKEN_DISABLE_JIT"

ft --version
ft doctor || true
ft kernels
ft kernels verify
if [ -z "${SKIP_TESTS:-}" ]; then
  (cd "$REPO" && python -m pytest -q -rs -p no:cacheprovider tests/kernel/test_cuda_kernels.py \
    tests/models/test_gpu_vs_hf.py -k "not compile")
  test ! -e "$FREETOKEN_JIT_DIR" && echo "== no JIT folder was created: zero compiles"
fi

if [ -n "$GGUF" ]; then
  ft serve --model "$GGUF" --device cuda --port 19190 >/tmp/ft-serve.log 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 120); do
    curl -sf http://127.0.0.1:19190/health >/dev/null && break
    kill -0 $server 2>/dev/null || { cat /tmp/ft-serve.log; exit 1; }
    sleep 1
  done
  reply=$(curl -sf http://127.0.0.1:19190/v1/chat/completions -H 'Content-Type: application/json' \
    -d '{"messages":[{"role":"user","content":"What is the capital of France? Answer in one sentence."}],"temperature":0,"max_tokens":40}')
  echo "$reply"
  grep -q Paris <<<"$reply" && echo "== GPU completion names Paris"
  curl -sf http://127.0.0.1:19190/v1/stats
  echo
  tail -5 /tmp/ft-serve.log
  test ! -e "$FREETOKEN_JIT_DIR" && echo "== still zero compiles after serving"
fi
