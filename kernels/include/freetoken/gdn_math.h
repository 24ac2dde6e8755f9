// Gated DeltaNet scalar math shared by the CPU and GPU kernels (host and device).
#pragma once

#include <cmath>

#if defined(__HIP__)
// HIP builds have no device math library (-nogpulib): clang builtins lower to amdgcn
// instructions. log(1 + e^x) instead of log1p: below x = -17 both round the decay to 1.
#define FT_GDN_FN __device__ __forceinline__
#define FT_GDN_EXP(x) __builtin_expf(x)
#define FT_GDN_LOG1P(x) __builtin_logf(1.f + (x))
#elif defined(__CUDACC__)
#define FT_GDN_FN __host__ __device__ __forceinline__
#define FT_GDN_EXP(x) expf(x)
#define FT_GDN_LOG1P(x) log1pf(x)
#else
#define FT_GDN_FN inline
#define FT_GDN_EXP(x) std::exp(x)
#define FT_GDN_LOG1P(x) std::log1p(x)
#endif

namespace freetoken {
namespace gdn {

constexpr int kMaxConvKernel = 8;   // the short convolution's taps (Qwen3.5/3.6: 4)
constexpr float kL2Eps = 1e-6f;     // q/k L2 norm epsilon, as the reference (FLA) uses

// torch's softplus (beta 1, threshold 20): linear above 20, where exp would overflow.
FT_GDN_FN float softplus(float x) { return x > 20.f ? x : FT_GDN_LOG1P(FT_GDN_EXP(x)); }

FT_GDN_FN float sigmoid(float x) { return 1.f / (1.f + FT_GDN_EXP(-x)); }

FT_GDN_FN float silu(float x) { return x / (1.f + FT_GDN_EXP(-x)); }

// The per-token log decay of the state, g = -exp(A_log) * softplus(a + dt_bias) <= 0.
FT_GDN_FN float log_decay(float a, float a_log, float dt_bias) {
  return -FT_GDN_EXP(a_log) * softplus(a + dt_bias);
}

// The per-token decay of the state, exp(g).
FT_GDN_FN float decay(float a, float a_log, float dt_bias) {
  return FT_GDN_EXP(log_decay(a, a_log, dt_bias));
}

}  // namespace gdn
}  // namespace freetoken
