// The chunked form of the gated delta rule, for long prefill chunks on the GPU (included by
// cuda/gdn.cu). tests/kernel/test_gdn_chunked.py writes the same steps in torch (chunked_head)
// and checks them against the token-by-token recurrence.
//
// Per sequence, value head and slice of kChunkCols value columns, chunks of C tokens with the
// state S0 before each (G the in-chunk cumulative log decay, inclusive):
//   A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i);  D = (I + A)^-1 beta (V - exp(G) K S0)
//   O_i  = exp(G_i) q_i S0 + sum_{j <= i} exp(G_i - G_j) (q_i.k_j) D_j
//   S    = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j D_j^T
// The inverse is applied by forward substitution (the UT correction), row by row. The state
// stays in the slot (global memory, read through the cache), updated once per chunk.
#pragma once

#include "freetoken/cuda_common.cuh"
#include "freetoken/gdn_math.h"

namespace freetoken {
namespace gdn {

constexpr int kChunkThreads = 256;
constexpr int kChunkCols = 64;   // value columns per block: what one block's D slice holds

struct ChunkArgs {
  int64_t hk, hv, dk, dv, qkv_stride, ba_stride, num_slots;
  const float* a_log;
  const float* dt_bias;
  float* state;
  const int64_t* positions;
  const int32_t* query_start_loc;
  const int32_t* state_slots;
};

/*! \brief Dynamic shared memory of chunked_kernel<T, C> for key head dim dk. */
inline size_t chunk_smem_bytes(int chunk, int64_t dk) {
  // q and k rows padded by one float (row-wise dot products without bank conflicts), the D
  // slice, A / P, and G, beta and the final decays
  return sizeof(float) * (2 * chunk * (dk + 1) + chunk * kChunkCols + chunk * chunk + 3 * chunk);
}

__device__ __forceinline__ float row_dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
  for (int64_t r = 0; r < n; ++r) acc += a[r] * b[r];
  return acc;
}

// The chunk's q, k (L2-normed; q scaled), v slice, beta and cumulative log decay: a warp a token.
template <typename T, int C>
__device__ void load_chunk(const T* __restrict__ qkv, const T* __restrict__ ba,
                           const ChunkArgs& p, int64_t c0, int n, int h, int64_t col0,
                           int cols, float* sq, float* sk, float* sd, float* sg, float* sb) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t dk = p.dk, ks = dk + 1, kh = h / (p.hv / p.hk);
  const float scale = rsqrtf(static_cast<float>(dk));
  for (int i = warp; i < n; i += kChunkThreads / kWarp) {   // uniform over the warp
    const T* row = qkv + (c0 + i) * p.qkv_stride;
    float qq = 0.f, kk = 0.f;
    for (int64_t e = lane; e < dk; e += kWarp) {
      const float q = to_float(row[kh * dk + e]), k = to_float(row[(p.hk + kh) * dk + e]);
      sq[i * ks + e] = q;
      sk[i * ks + e] = k;
      qq += q * q;
      kk += k * k;
    }
    const float qn = scale * rsqrtf(warp_sum(qq) + kL2Eps);
    const float kn = rsqrtf(warp_sum(kk) + kL2Eps);
    for (int64_t e = lane; e < dk; e += kWarp) {
      sq[i * ks + e] *= qn;
      sk[i * ks + e] *= kn;
    }
    for (int c = lane; c < cols; c += kWarp) {
      sd[i * kChunkCols + c] = to_float(row[2 * p.hk * dk + h * p.dv + col0 + c]);
    }
    if (lane == 0) {
      const T* g = ba + (c0 + i) * p.ba_stride;
      sb[i] = sigmoid(to_float(g[h]));
      sg[i] = log_decay(to_float(g[p.hv + h]), p.a_log[h], p.dt_bias[h]);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < n; ++i) sg[i] += sg[i - 1];
  }
  __syncthreads();
}

// D = (I + A)^-1 beta (V - exp(G) K S0) in sd (which holds V on entry); A in sm.
template <int C>
__device__ void chunk_deltas(const float* st, const ChunkArgs& p, int n, int cols,
                             const float* sk, float* sd, float* sm, const float* sg,
                             const float* sb) {
  const int64_t dk = p.dk, ks = dk + 1;
  for (int e = threadIdx.x; e < n * kChunkCols; e += kChunkThreads) {
    const int i = e / kChunkCols, c = e % kChunkCols;
    if (c >= cols) continue;
    float acc = 0.f;
    for (int64_t r = 0; r < dk; ++r) acc += sk[i * ks + r] * st[r * p.dv + c];
    sd[e] = sb[i] * (sd[e] - FT_GDN_EXP(sg[i]) * acc);
  }
  for (int e = threadIdx.x; e < C * C; e += kChunkThreads) {
    const int i = e / C, j = e % C;
    sm[e] = (j < i && i < n)
                ? sb[i] * FT_GDN_EXP(sg[i] - sg[j]) * row_dot(sk + i * ks, sk + j * ks, dk)
                : 0.f;
  }
  __syncthreads();
  for (int i = 1; i < n; ++i) {   // row i needs the final rows j < i
    for (int c = threadIdx.x; c < cols; c += kChunkThreads) {
      float acc = 0.f;
      for (int j = 0; j < i; ++j) acc += sm[i * C + j] * sd[j * kChunkCols + c];
      sd[i * kChunkCols + c] -= acc;
    }
    __syncthreads();
  }
}

template <typename T, int C>
__global__ void __launch_bounds__(kChunkThreads)
    chunked_kernel(T* __restrict__ out, const T* __restrict__ qkv, const T* __restrict__ ba,
                   ChunkArgs p) {
  extern __shared__ float smem[];
  const int64_t dk = p.dk, ks = dk + 1;
  float* sq = smem;                   // [C][dk + 1]
  float* sk = sq + C * ks;            // [C][dk + 1]
  float* sd = sk + C * ks;            // [C][kChunkCols]: v, then D
  float* sm = sd + C * kChunkCols;    // [C][C]: A, then P
  float* sg = sm + C * C;             // [C] G
  float* sb = sg + C;                 // [C] beta
  float* sw = sb + C;                 // [C] exp(G_last - G_j)
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kChunkCols;
  const int cols = static_cast<int>(p.dv - col0 < kChunkCols ? p.dv - col0 : kChunkCols);
  const int64_t begin = p.query_start_loc[b], end = p.query_start_loc[b + 1];
  const int64_t slot = p.state_slots[b];
  if (end <= begin || slot < 0 || slot >= p.num_slots) return;   // uniform over the block
  float* st = p.state + (slot * p.hv + h) * dk * p.dv + col0;   // row r at st[r * dv]
  if (p.positions[begin] == 0) {
    for (int64_t e = threadIdx.x; e < dk * cols; e += kChunkThreads) {
      st[e / cols * p.dv + e % cols] = 0.f;
    }
  }
  __syncthreads();
  for (int64_t c0 = begin; c0 < end; c0 += C) {
    const int n = static_cast<int>(end - c0 < C ? end - c0 : C);
    load_chunk<T, C>(qkv, ba, p, c0, n, h, col0, cols, sq, sk, sd, sg, sb);
    chunk_deltas<C>(st, p, n, cols, sk, sd, sm, sg, sb);
    for (int e = threadIdx.x; e < C * C; e += kChunkThreads) {   // P over A
      const int i = e / C, j = e % C;
      sm[e] = (j <= i && i < n)
                  ? FT_GDN_EXP(sg[i] - sg[j]) * row_dot(sq + i * ks, sk + j * ks, dk)
                  : 0.f;
    }
    if (threadIdx.x < n) sw[threadIdx.x] = FT_GDN_EXP(sg[n - 1] - sg[threadIdx.x]);
    __syncthreads();
    for (int e = threadIdx.x; e < n * kChunkCols; e += kChunkThreads) {
      const int i = e / kChunkCols, c = e % kChunkCols;
      if (c >= cols) continue;
      float acc = 0.f;
      for (int64_t r = 0; r < dk; ++r) acc += sq[i * ks + r] * st[r * p.dv + c];
      acc *= FT_GDN_EXP(sg[i]);
      for (int j = 0; j <= i; ++j) acc += sm[i * C + j] * sd[j * kChunkCols + c];
      out[(c0 + i) * p.hv * p.dv + h * p.dv + col0 + c] = from_float<T>(acc);
    }
    __syncthreads();   // every read of S0 is done
    const float last = FT_GDN_EXP(sg[n - 1]);
    for (int64_t e = threadIdx.x; e < dk * cols; e += kChunkThreads) {
      const int64_t r = e / cols;
      const int c = static_cast<int>(e % cols);
      float acc = last * st[r * p.dv + c];
      for (int j = 0; j < n; ++j) acc += sw[j] * sk[j * ks + r] * sd[j * kChunkCols + c];
      st[r * p.dv + c] = acc;
    }
    __syncthreads();   // the next chunk reads the new state and refills the buffers
  }
}

}  // namespace gdn
}  // namespace freetoken
