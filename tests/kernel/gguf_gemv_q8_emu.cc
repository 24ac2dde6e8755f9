// Host run of the int8-activation decode GEMV (kernels/cuda/gguf_gemv_q8.cu, its kernel part)
// on CPU threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every type,
// rows-per-warp and token instantiation, mode and the norm prologue, launched through the
// kernel's own dispatch; checked by tests/kernel/test_gguf_gemv_q8_emulated.py. dp4a runs as 4
// byte products (the HIP form).
#include <cmath>

#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "../../kernels/cuda/gguf_gemv_q8.cu"

namespace q8 = freetoken::gemv_q8;
using freetoken::bf16;
using freetoken::emu::launch;

namespace {

template <int MODE>
bool run_mode(const q8::Args& a, int qtype, int rows) {
  return q8::dispatch<MODE>(a, qtype, rows, [&](auto kernel, unsigned blocks, int threads) {
    launch(blocks, 1, static_cast<unsigned>(threads), [&] { kernel(a); });
  });
}

}  // namespace

// out (bf16 or f32 bits), x, bias (or null), norm (or null): bf16 bit patterns; x rows ldx
// apart, out rows ldo apart; w: rows of qtype blocks (2n of them for mode 2). Returns 0 for
// what the real entry point refuses (it raises there), else 1.
extern "C" int ft_gguf_gemv_q8_emu(void* out, int out_f32, const void* x, const void* w,
                                   const void* bias, const void* norm, long ldx, long ldo,
                                   int tokens, long n, long k, int qtype, int mode, int rows,
                                   float eps) {
  int weights = 0, block_bytes = 0;
  freetoken::gguf::block_shape(qtype, &weights, &block_bytes);
  if (weights == 0 || k % weights != 0 || (k / weights * block_bytes) % 16 != 0 ||
      tokens < 1 || tokens > q8::kMaxTokens || tokens * k > q8::capacity(qtype) ||
      (out_f32 && mode != q8::kStore) || rows < 0 || rows > 2 || ldx % 8 != 0) {
    return 0;
  }
  q8::Args a{out, static_cast<const bf16*>(x), static_cast<const uint8_t*>(w),
             static_cast<const bf16*>(bias), static_cast<const bf16*>(norm), n, k,
             k / weights * block_bytes, ldx, ldo, tokens, out_f32 != 0, eps};
  if (mode == q8::kStore) return run_mode<q8::kStore>(a, qtype, rows);
  if (mode == q8::kAddResidual) return run_mode<q8::kAddResidual>(a, qtype, rows);
  if (mode == q8::kSwiGLU) return run_mode<q8::kSwiGLU>(a, qtype, rows);
  return 0;
}
