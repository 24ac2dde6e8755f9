// Host run of the decode GEMV (kernels/cuda/decode_gemv.cu, its kernel part) on CPU threads
// through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every variant of
// freetoken/gemv_knobs.cuh (block size, unroll, pipelined loads; cache hints and programmatic
// launch are GPU-only and fall back to plain loads / no waits, as on HIP), every token-count
// instantiation, epilogue and the norm prologue, checked by
// tests/kernel/test_decode_gemv_emulated.py.
#include <cmath>
#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "../../kernels/cuda/decode_gemv.cu"

namespace fe = freetoken::emu;
namespace ft = freetoken;
using freetoken::bf16;

namespace {

using freetoken::emu::launch;

// decode_gemv.cu's launch_nt, launch_variant and launch, with the host launcher.
template <int NT, int MODE, int VARIANT>
void run_nt(const ft::GemvArgs& a) {
  constexpr ft::GemvKnobs k = ft::kGemvVariants[VARIANT];
  using C = ft::Knobs<k.threads, k.unroll, k.load, k.pipe>;
  auto grid = static_cast<unsigned>(ft::ceil_div(a.n, C::kThreads / a.group));
  if (MODE != ft::kAddResidual && a.norm != nullptr) {
    constexpr bool norm = MODE != ft::kAddResidual;
    launch(grid, 1, C::kThreads, [&] { ft::gemv_kernel<bf16, NT, MODE, norm, C>(a); });
  } else {
    launch(grid, 1, C::kThreads, [&] { ft::gemv_kernel<bf16, NT, MODE, false, C>(a); });
  }
}

template <int MODE, int VARIANT = 0>
void run(const ft::GemvArgs& a, int variant) {
  if constexpr (VARIANT < ft::kNumGemvVariants) {
    if (variant != VARIANT) return run<MODE, VARIANT + 1>(a, variant);
    if (a.tokens <= 1) return run_nt<1, MODE, VARIANT>(a);
    if (a.tokens <= 2) return run_nt<2, MODE, VARIANT>(a);
    if (a.tokens <= 4) return run_nt<4, MODE, VARIANT>(a);
    run_nt<8, MODE, VARIANT>(a);
  }
}

}  // namespace

// out, x, w, bias (or null), norm (or null): bf16 bit patterns; x rows x_stride apart.
// mode: 0 plain, 1 residual add (out is the residual), 2 SwiGLU (w has 2n rows). Returns 0 on
// a configuration the real entry point rejects (it raises there), else 1.
extern "C" int ft_decode_gemv_emu(void* out, const void* x, const void* w, const void* bias,
                                  const void* norm, long x_stride, int tokens, int n, int k,
                                  int group, int variant, int mode, float eps) {
  if (variant < 0 || variant >= ft::kNumGemvVariants || tokens < 1 || tokens > ft::kMaxTokens ||
      k % 8 != 0 || group > ft::kGemvVariants[variant].threads || group % 32 != 0) {
    return 0;
  }
  ft::GemvArgs a{out, x, w, bias, norm, x_stride, n, tokens, n, k / 8, group, eps,
                 1.f / static_cast<float>(k)};
  if (mode == ft::kPlain) run<ft::kPlain>(a, variant);
  if (mode == ft::kAddResidual) run<ft::kAddResidual>(a, variant);
  if (mode == ft::kSwiGLU) run<ft::kSwiGLU>(a, variant);
  return 1;
}
