// Host run of the int8-activation Q4_K decode GEMV (kernels/cuda/gguf_gemv_q8.cu, its kernel
// part) on CPU threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every
// rows-per-warp and token instantiation, mode and the norm prologue, as gguf_gemv_q8's launch
// part dispatches them; checked by tests/kernel/test_gguf_gemv_q8_emulated.py. dp4a runs as 4
// byte products (the HIP form).
#include <cmath>

#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "../../kernels/cuda/gguf_gemv_q8.cu"

namespace q8 = freetoken::gemv_q8;
using freetoken::bf16;
using freetoken::emu::launch;

namespace {

template <int R, int NT, int MODE>
void run_kernel(const q8::Args& a) {
  const auto grid = static_cast<unsigned>(freetoken::ceil_div(a.n, q8::kWarps * R));
  launch(grid, 1, q8::kThreads, [&] { q8::q4k_gemv_kernel<R, NT, MODE>(a); });
}

template <int MODE>
void run_mode(const q8::Args& a, int rows) {
  const bool two_rows = rows == 2 || (rows == 0 && a.tokens > 1);
  if (a.tokens == 1) {
    if (two_rows) return run_kernel<2, 1, MODE>(a);
    return run_kernel<1, 1, MODE>(a);
  }
  if (two_rows) return run_kernel<2, 2, MODE>(a);
  run_kernel<1, 2, MODE>(a);
}

}  // namespace

// out (bf16 or f32 bits), x, bias (or null), norm (or null): bf16 bit patterns; x rows ldx
// apart, out rows ldo apart; w: Q4_K rows (2n of them for mode 2). Returns 0 for what the real
// entry point refuses (it raises there), else 1.
extern "C" int ft_gguf_gemv_q8_emu(void* out, int out_f32, const void* x, const void* w,
                                   const void* bias, const void* norm, long ldx, long ldo,
                                   int tokens, long n, long k, int mode, int rows, float eps) {
  if (tokens < 1 || tokens > q8::kMaxTokens || tokens * k > q8::kXCapacity ||
      k % q8::kBlockWeights != 0 || (out_f32 && mode != q8::kStore) || rows < 0 || rows > 2 ||
      ldx % 8 != 0) {
    return 0;
  }
  q8::Args a{out, static_cast<const bf16*>(x), static_cast<const uint8_t*>(w),
             static_cast<const bf16*>(bias), static_cast<const bf16*>(norm), n, k,
             k / q8::kBlockWeights * q8::kBlockBytes, ldx, ldo, tokens, out_f32 != 0, eps};
  if (mode == q8::kStore) run_mode<q8::kStore>(a, rows);
  else if (mode == q8::kAddResidual) run_mode<q8::kAddResidual>(a, rows);
  else if (mode == q8::kSwiGLU) run_mode<q8::kSwiGLU>(a, rows);
  else return 0;
  return 1;
}
