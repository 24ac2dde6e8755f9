// The RMSNorm prologue of the fused decode GEMVs over quantized weights (gguf_gemv_q8.cu,
// fp8_gemv.cu): each block reduces its tokens' sums of squares itself, every thread
// cooperating, so the norm needs no kernel of its own. inv_rms as the unfused rms_norm (and
// decode_gemv's prologue) computes it: rsqrt(sum(x^2) * (1 / K) + eps).
#pragma once

#include <cstdint>

#include "freetoken/cuda_common.cuh"

namespace freetoken {

/*! \brief inv_rms[t] (shared memory, NT entries) of x rows t < tokens, [tokens, k] ldx apart
 * (16-byte aligned, k a multiple of 8), by the block's THREADS threads; ends synchronised. */
template <typename T, int NT, int THREADS>
__device__ void block_inv_rms(const T* x, int64_t ldx, int64_t k, int tokens, float eps,
                              float* inv_rms) {
  __shared__ float part[THREADS / kWarp][NT];
  float ss[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) ss[t] = 0.f;
  for (int64_t i = threadIdx.x; i < k / 8; i += THREADS) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= tokens) break;
      Vec<T, 8> v = load_vec<T, 8>(x + t * ldx + 8 * i);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss[t] += to_float(v.v[e]) * to_float(v.v[e]);
    }
  }
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const float s = warp_sum(ss[t]);
    if (lane == 0) part[warp][t] = s;
  }
  __syncthreads();
  if (threadIdx.x < NT) {
    float s = 0.f;
    for (int w = 0; w < THREADS / kWarp; ++w) s += part[w][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(s * (1.f / static_cast<float>(k)) + eps);
  }
  __syncthreads();
}

}  // namespace freetoken
