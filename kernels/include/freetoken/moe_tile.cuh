// The grouped-GEMM tile of the MoE prefill path (kernels/cuda/moe.cu): a 64-row block of
// gathered A rows times BN gathered B rows, both indexed by per-row element offsets in shared
// memory (a negative offset reads zeros, so partial tiles and ragged edges need no branches in
// the math). k-slices of 32 are staged through shared memory with the next slice prefetched into
// registers during the math; bf16/f16 on CUDA use wmma 16x16x16 tensor-core fragments with f32
// accumulation, everything else (f32, HIP) a CUDA-core FMA tile. The f32 result lands in shared
// memory for the caller's epilogue.
#pragma once

#include "freetoken/cuda_common.cuh"

#if !defined(__HIP_PLATFORM_AMD__)
#include <mma.h>
#endif

namespace freetoken {
namespace moe_tile {

constexpr int kTM = 64, kTK = 32, kTileThreads = 128;

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> zero_vec() {
  Vec<T, N> z;
#pragma unroll
  for (int e = 0; e < N; ++e) z.v[e] = from_float<T>(0.f);
  return z;
}

// Shared memory of one tile block: the staged A [kTM][kTK] and B [BN][kTK] k-slices, then,
// reusing the same bytes, the f32 accumulator tile C [kTM][BN] for the epilogue.
template <typename T, int BN>
struct TileLayout {
  static constexpr int kLd = kTK + 16 / static_cast<int>(sizeof(T));  // pad: fewer bank conflicts
  static constexpr int kLdc = BN + 4;
  static constexpr int kStage = (kTM + BN) * kLd * static_cast<int>(sizeof(T));
  static constexpr int kC = kTM * kLdc * 4;
  static constexpr int kBytes = kStage > kC ? kStage : kC;
};

template <int N>
struct alignas(128) SmemBuf {  // wmma wants 32-byte aligned fragment pointers
  unsigned char bytes[N];
};

// C[r][n] = sum_k A[arow[r] + k] * B[brow[n] + k] over k < kdim; a row offset < 0 reads zeros.
template <typename T, int BN, bool TC, int VEC>
__device__ __forceinline__ void tile_gemm(unsigned char* smem, const T* __restrict__ A,
                                          const int64_t* s_arow, const T* __restrict__ B,
                                          const int64_t* s_brow, int64_t kdim) {
  using L = TileLayout<T, BN>;
  constexpr int kCols = kTK / VEC;
  constexpr int kNA = kTM * kCols / kTileThreads, kNB = BN * kCols / kTileThreads;
  T* As = reinterpret_cast<T*>(smem);
  T* Bs = As + kTM * L::kLd;
  float* C = reinterpret_cast<float*>(smem);
  int tid = threadIdx.x;
  Vec<T, VEC> ra[kNA], rb[kNB];
  auto fetch = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < kNA; ++i) {
      int idx = tid + i * kTileThreads, r = idx / kCols, c = (idx % kCols) * VEC;
      int64_t off = s_arow[r];
      ra[i] = off >= 0 && k0 + c < kdim ? load_vec<T, VEC>(A + off + k0 + c) : zero_vec<T, VEC>();
    }
#pragma unroll
    for (int i = 0; i < kNB; ++i) {
      int idx = tid + i * kTileThreads, r = idx / kCols, c = (idx % kCols) * VEC;
      int64_t off = s_brow[r];
      rb[i] = off >= 0 && k0 + c < kdim ? load_vec<T, VEC>(B + off + k0 + c) : zero_vec<T, VEC>();
    }
  };
  auto stage = [&]() {
#pragma unroll
    for (int i = 0; i < kNA; ++i) {
      int idx = tid + i * kTileThreads;
      store_vec<T, VEC>(As + (idx / kCols) * L::kLd + (idx % kCols) * VEC, ra[i]);
    }
#pragma unroll
    for (int i = 0; i < kNB; ++i) {
      int idx = tid + i * kTileThreads;
      store_vec<T, VEC>(Bs + (idx / kCols) * L::kLd + (idx % kCols) * VEC, rb[i]);
    }
  };
#if !defined(__HIP_PLATFORM_AMD__)
  if constexpr (TC) {
    // 4 warps as 2 x 2: each owns 32 rows x BN/2 columns of 16x16 fragments.
    namespace wmma = nvcuda::wmma;
    constexpr int kFN = BN / 32;
    int warp = tid / kWarp, wm = warp / 2, wn = warp % 2;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][kFN];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < kFN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    fetch(0);
    for (int64_t k0 = 0; k0 < kdim; k0 += kTK) {
      stage();
      __syncthreads();
      if (k0 + kTK < kdim) fetch(k0 + kTK);  // next slice in flight during the math
#pragma unroll
      for (int kk = 0; kk < kTK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[2];
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[kFN];
#pragma unroll
        for (int i = 0; i < 2; ++i)
          wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * L::kLd + kk, L::kLd);
#pragma unroll
        for (int j = 0; j < kFN; ++j)
          wmma::load_matrix_sync(fb[j], Bs + (wn * (BN / 2) + j * 16) * L::kLd + kk, L::kLd);
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
    __syncthreads();
    return;
  }
#endif
  // CUDA-core tile: thread (ty, tx) of 8 x 16 owns rows ty + 8i and columns tx + 16j.
  constexpr int kJ = BN / 16;
  int tx = tid % 16, ty = tid / 16;
  float acc[8][kJ] = {};
  fetch(0);
  for (int64_t k0 = 0; k0 < kdim; k0 += kTK) {
    stage();
    __syncthreads();
    if (k0 + kTK < kdim) fetch(k0 + kTK);
#pragma unroll 4
    for (int kk = 0; kk < kTK; ++kk) {
      float av[8], bv[kJ];
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = to_float(As[(ty + 8 * i) * L::kLd + kk]);
#pragma unroll
      for (int j = 0; j < kJ; ++j) bv[j] = to_float(Bs[(tx + 16 * j) * L::kLd + kk]);
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
  __syncthreads();
}

}  // namespace moe_tile
}  // namespace freetoken
