// The grouped-GEMM tile of the GGUF MoE prefill path (kernels/cuda/moe_gguf.cu): a 64-row block
// of gathered bf16 activation rows times BN gathered weight rows kept in GGUF blocks. Each
// 32-wide k-slice stages the activations as they are and the weights decoded by
// gguf::decode8 (the host-tested reader) into shared memory as bf16, then multiplies them with
// wmma 16x16x16 bf16 tensor cores (f32 accumulation); HIP builds use a CUDA-core FMA tile
// instead (no wmma there). Rows are addressed by offsets in shared memory (elements of A, bytes
// of B); a negative offset reads zeros, so partial tiles need no branches in the math. The f32
// result lands in shared memory for the caller's epilogue. No prefetch: this is the plain,
// obviously right version, in the shape of moe_tile.cuh.
#pragma once

#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"

#if !defined(__HIP_PLATFORM_AMD__)
#include <mma.h>
#endif

namespace freetoken {
namespace moe_gguf_tile {

constexpr int kTM = 64, kTK = 32, kThreads = 128;
constexpr int kLd = kTK + 8;  // bf16 row pitch of the staged slices: fewer bank conflicts

// Shared memory of one tile block: A [kTM][kLd] and B [BN][kLd] bf16 slices, then, reusing the
// same bytes, the f32 accumulator tile C [kTM][kLdc].
template <int BN>
struct Layout {
  static constexpr int kLdc = BN + 4;
  static constexpr int kStage = (kTM + BN) * kLd * 2;
  static constexpr int kC = kTM * kLdc * 4;
  static constexpr int kBytes = kStage > kC ? kStage : kC;
};

// Stages the k-slice [k0, k0 + 32) of the 64 A rows and the BN decoded B rows as bf16.
template <int QT, int BN>
__device__ __forceinline__ void stage(bf16* As, bf16* Bs, const bf16* __restrict__ A,
                                      const int64_t* s_arow, const uint8_t* __restrict__ B,
                                      const int64_t* s_brow, int64_t k0) {
  using Blk = gguf::Block<QT>;
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < kTM * 4 / kThreads; ++i) {  // 4 groups of 8 per row
    const int idx = tid + i * kThreads, r = idx / 4, c = (idx % 4) * 8;
    const int64_t off = s_arow[r];
    Vec<bf16, 8> v;
    if (off >= 0) {
      v = load_vec<bf16, 8>(A + off + k0 + c);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v.v[e] = from_float<bf16>(0.f);
    }
    store_vec<bf16, 8>(As + r * kLd + c, v);
  }
#pragma unroll
  for (int i = 0; i < BN * 4 / kThreads; ++i) {
    const int idx = tid + i * kThreads, r = idx / 4, c = (idx % 4) * 8;
    const int64_t off = s_brow[r], col = k0 + c;
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (off >= 0)
      gguf::decode8<QT>(B + off + (col / Blk::kWeights) * Blk::kBytes,
                        static_cast<int>((col % Blk::kWeights) / 8), f);
    Vec<bf16, 8> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = from_float<bf16>(f[e]);
    store_vec<bf16, 8>(Bs + r * kLd + c, v);
  }
}

/*! \brief C[r][n] = sum_k A[arow[r] + k] * w_n[k] over k < kdim (a multiple of 32, as every
 * GGUF row is), w_n the row of GGUF blocks at byte offset brow[n] of B. */
template <int QT, int BN>
__device__ __forceinline__ void tile_gemm(unsigned char* smem, const bf16* __restrict__ A,
                                          const int64_t* s_arow, const uint8_t* __restrict__ B,
                                          const int64_t* s_brow, int64_t kdim) {
  using L = Layout<BN>;
  bf16* As = reinterpret_cast<bf16*>(smem);
  bf16* Bs = As + kTM * kLd;
  float* C = reinterpret_cast<float*>(smem);
  const int tid = threadIdx.x;
#if !defined(__HIP_PLATFORM_AMD__)
  // 4 warps as 2 x 2: each owns 32 rows x BN/2 columns of 16x16 fragments.
  namespace wmma = nvcuda::wmma;
  constexpr int kFN = BN / 32;
  const int warp = tid / kWarp, wm = warp / 2, wn = warp % 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][kFN];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < kFN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  for (int64_t k0 = 0; k0 < kdim; k0 += kTK) {
    stage<QT, BN>(As, Bs, A, s_arow, B, s_brow, k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb[kFN];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * kLd + kk, kLd);
#pragma unroll
      for (int j = 0; j < kFN; ++j)
        wmma::load_matrix_sync(fb[j], Bs + (wn * (BN / 2) + j * 16) * kLd + kk, kLd);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < kFN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < kFN; ++j)
      wmma::store_matrix_sync(C + (wm * 32 + i * 16) * L::kLdc + wn * (BN / 2) + j * 16,
                              acc[i][j], L::kLdc, wmma::mem_row_major);
#else
  // CUDA-core tile: thread (ty, tx) of 8 x 16 owns rows ty + 8i and columns tx + 16j.
  constexpr int kJ = BN / 16;
  const int tx = tid % 16, ty = tid / 16;
  float acc[8][kJ] = {};
  for (int64_t k0 = 0; k0 < kdim; k0 += kTK) {
    stage<QT, BN>(As, Bs, A, s_arow, B, s_brow, k0);
    __syncthreads();
    for (int kk = 0; kk < kTK; ++kk) {
      float av[8], bv[kJ];
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = to_float(As[(ty + 8 * i) * kLd + kk]);
#pragma unroll
      for (int j = 0; j < kJ; ++j) bv[j] = to_float(Bs[(tx + 16 * j) * kLd + kk]);
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < kJ; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < kJ; ++j) C[(ty + 8 * i) * L::kLdc + tx + 16 * j] = acc[i][j];
#endif
  __syncthreads();
}

}  // namespace moe_gguf_tile
}  // namespace freetoken
