// One warp's share of a flash-attention tile on tensor cores (mma.m16n8k16, f32 accumulators),
// shared by the paged attention and the vision attention kernels. The warp owns 16 query rows;
// a lane holds rows lane / 4 and lane / 4 + 8, columns 2 * (lane % 4) + {0, 1} of each 8-wide
// tile. Q, K and V sit in shared memory with a row pitch of LD elements.
#pragma once

#include "freetoken/cuda_common.cuh"

#if !defined(__HIP_PLATFORM_AMD__)
namespace freetoken {

/*! \brief s += Q[row0 .. row0 + 15] . K[0 .. BN - 1]^T over D columns (D a multiple of 16). */
template <typename T, int D, int BN, int LD>
__device__ __forceinline__ void warp_scores(const T* sQ, const T* sK, int row0,
                                            float (&s)[BN / 8][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kd = 0; kd < D / 16; ++kd) {
    uint32_t a[4];
    ldmatrix_x4(a, sQ + (row0 + lane % 8 + ((lane / 8) % 2) * 8) * LD + kd * 16 +
                       (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < BN / 8; nt += 2) {
      uint32_t kb[4];
      ldmatrix_x4(kb, sK + (nt * 8 + (lane / 16) * 8 + lane % 8) * LD + kd * 16 +
                          ((lane / 8) % 2) * 8);
      mma_16816<T>(s[nt], a, kb[0], kb[1]);
      mma_16816<T>(s[nt + 1], a, kb[2], kb[3]);
    }
  }
}

/*! \brief o += P . V[0 .. BN - 1]: P is s rounded to T (two key tiles of s form one A
 * fragment), D output columns (a multiple of 16). */
template <typename T, int D, int BN, int LD>
__device__ __forceinline__ void warp_values(const T* sV, const float (&s)[BN / 8][4],
                                            float (&o)[D / 8][4]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                     pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                     pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
    for (int dt = 0; dt < D / 8; dt += 2) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, sV + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD + dt * 8 +
                                (lane / 16) * 8);
      mma_16816<T>(o[dt], a, vb[0], vb[1]);
      mma_16816<T>(o[dt + 1], a, vb[2], vb[3]);
    }
  }
}

}  // namespace freetoken
#endif  // !__HIP_PLATFORM_AMD__
