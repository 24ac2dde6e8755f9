// The prefill tile of gguf_gemm (kernels/cuda/gguf_gemm.cu): a 64 x 64 output tile per block
// of 128 threads; each 32-wide k-slice of the weight is decoded (gguf::decode8) into shared
// memory as bf16 beside the activation slice and multiplied with wmma 16x16x16 bf16 tensor
// cores (f32 accumulation). HIP builds use a CUDA-core FMA tile instead (no wmma there).
#pragma once

#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"

#if !defined(__HIP_PLATFORM_AMD__)
#include <mma.h>
#endif

namespace freetoken {
namespace gguf_tile {

using gguf::Block;
using gguf::decode8;

constexpr int kTile = 64, kTK = 32, kLd = kTK + 8, kLdc = kTile + 4, kThreads = 128;

__device__ __forceinline__ void store_out(void* out, bool out_f32, int64_t i, float v) {
  if (out_f32) {
    static_cast<float*>(out)[i] = v;
  } else {
    static_cast<bf16*>(out)[i] = from_float<bf16>(v);
  }
}

// Stages the 64 x 32 activation slice and the decoded 64 x 32 weight slice as bf16.
template <int QT>
__device__ __forceinline__ void stage_tile(bf16* As, bf16* Bs, const bf16* __restrict__ x,
                                           const uint8_t* __restrict__ w, int64_t m0,
                                           int64_t n0, int64_t k0, int64_t m_rows, int64_t n,
                                           int64_t row_bytes, int64_t ldx) {
  using B = Block<QT>;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int idx = threadIdx.x + i * kThreads, r = idx / 4, c = (idx % 4) * 8;
    Vec<bf16, 8> v;
    if (m0 + r < m_rows) {
      v = load_vec<bf16, 8>(x + (m0 + r) * ldx + k0 + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v.v[e] = from_float<bf16>(0.f);
    }
    store_vec<bf16, 8>(As + r * kLd + c, v);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int idx = threadIdx.x + i * kThreads, r = idx / 4;
    const int64_t col = k0 + (idx % 4) * 8;
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (n0 + r < n)
      decode8<QT>(w + (n0 + r) * row_bytes + (col / B::kWeights) * B::kBytes,
                  static_cast<int>((col % B::kWeights) / 8), f);
    Vec<bf16, 8> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = from_float<bf16>(f[e]);
    store_vec<bf16, 8>(Bs + r * kLd + (idx % 4) * 8, v);
  }
}

template <int QT>
__global__ void __launch_bounds__(kThreads)
    gemm_kernel(void* out, bool out_f32, const bf16* __restrict__ x,
                const uint8_t* __restrict__ w, int64_t m_rows, int64_t n, int64_t k,
                int64_t row_bytes, int64_t ldx, int64_t ldo) {
  constexpr int kStage = 2 * kTile * kLd * 2, kC = kTile * kLdc * 4;
  __shared__ __attribute__((aligned(128))) unsigned char smem[kStage > kC ? kStage : kC];
  bf16* As = reinterpret_cast<bf16*>(smem);
  bf16* Bs = As + kTile * kLd;
  float* C = reinterpret_cast<float*>(smem);
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x;
#if !defined(__HIP_PLATFORM_AMD__)
  // 4 warps as 2 x 2, each owning 32 x 32 of the tile as 2 x 2 fragments.
  namespace wmma = nvcuda::wmma;
  const int warp = tid / kWarp, wm = warp / 2, wn = warp % 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  for (int64_t k0 = 0; k0 < k; k0 += kTK) {
    stage_tile<QT>(As, Bs, x, w, m0, n0, k0, m_rows, n, row_bytes, ldx);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[2];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * kLd + kk, kLd);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(fb[j], Bs + (wn * 32 + j * 16) * kLd + kk, kLd);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(C + (wm * 32 + i * 16) * kLdc + wn * 32 + j * 16, acc[i][j], kLdc,
                              wmma::mem_row_major);
#else
  // CUDA-core tile: thread (ty, tx) of 8 x 16 owns rows ty + 8i and columns tx + 16j.
  const int tx = tid % 16, ty = tid / 16;
  float acc[8][4] = {};
  for (int64_t k0 = 0; k0 < k; k0 += kTK) {
    stage_tile<QT>(As, Bs, x, w, m0, n0, k0, m_rows, n, row_bytes, ldx);
    __syncthreads();
    for (int kk = 0; kk < kTK; ++kk) {
      float av[8], bv[4];
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = to_float(As[(ty + 8 * i) * kLd + kk]);
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = to_float(Bs[(tx + 16 * j) * kLd + kk]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) C[(ty + 8 * i) * kLdc + tx + 16 * j] = acc[i][j];
#endif
  __syncthreads();
  for (int idx = tid; idx < kTile * kTile; idx += kThreads) {
    const int r = idx / kTile, c = idx % kTile;
    if (m0 + r < m_rows && n0 + c < n) store_out(out, out_f32, (m0 + r) * ldo + n0 + c,
                                                 C[r * kLdc + c]);
  }
}

}  // namespace gguf_tile
}  // namespace freetoken
