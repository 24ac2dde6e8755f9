// Gated DeltaNet scalar math shared by the CPU and GPU kernels (host and device).
#pragma once

#include <cmath>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FT_GDN_FN __host__ __device__ __forceinline__
#else
#define FT_GDN_FN inline
#endif

namespace freetoken {
namespace gdn {

constexpr int kMaxConvKernel = 8;   // the short convolution's taps (Qwen3.5/3.6: 4)
constexpr float kL2Eps = 1e-6f;     // q/k L2 norm epsilon, as the reference (FLA) uses

// torch's softplus (beta 1, threshold 20): linear above 20, where exp would overflow.
FT_GDN_FN float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

FT_GDN_FN float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

FT_GDN_FN float silu(float x) { return x / (1.f + expf(-x)); }

// The per-token decay of the state, exp(g) with g = -exp(A_log) * softplus(a + dt_bias) <= 0.
FT_GDN_FN float decay(float a, float a_log, float dt_bias) {
  return expf(-expf(a_log) * softplus(a + dt_bias));
}

}  // namespace gdn
}  // namespace freetoken
