// The device kernels of the GGUF MoE experts (kernels/cuda/moe_gguf.cu holds their host
// dispatch): GEMV gate/up and down for decode, tiled gate/up and down plus the per-token combine
// for prefill, over the tile table of freetoken/moe_align.cuh. Kept apart from the host code so
// a host build can run them on CPU threads (tests/kernel/moe_gguf_emu.cc).
#pragma once

#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"
#include "freetoken/moe_align.cuh"
#include "freetoken/moe_gguf_tile.cuh"

namespace freetoken {
namespace moe_gguf {

using gguf::Block;
using moe_align::kGemvRows;
using moe_align::Plan;
using moe_align::silu_mul;
using moe_align::slot_of;
using moe_align::TileTable;
using moe_gguf_tile::kThreads;
using moe_gguf_tile::kTM;
using moe_gguf_tile::Layout;
static_assert(moe_align::kTileRows == kTM, "the plan's prefill tiles are the GEMM tile's rows");

constexpr int kGemvWarps = 8;

struct QArgs {
  bf16* out;              // [T, H]
  const bf16* x;          // [T, H]
  const uint8_t* w13;     // [S, 2I, rb13]
  const uint8_t* w2;      // [S, H, rb2]
  int64_t rb13, rb2;      // bytes per weight row
  const int* topk_ids;    // [T, K]
  const float* topk_w;    // [T, K]
  const int* expert_map;
  TileTable tt;
  const int* sorted;  // [pairs] pair ids (t * K + k) grouped by expert
  bf16* act;          // [pairs, I] silu(gate) * up, by pair id
  float* y;           // [pairs, y_cols] one down-projection column chunk, by pair id
  int tokens, top_k, experts, slots, hidden, inter;
  int64_t y_cols;
};

// x[0..32) as floats and the sums of its halves (dot32's inputs); p 16-byte aligned.
__device__ __forceinline__ void load32(const bf16* p, float* xv, float* xlo, float* xhi) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    Vec<bf16, 8> v = load_vec<bf16, 8>(p + 8 * i);
#pragma unroll
    for (int e = 0; e < 8; ++e) xv[8 * i + e] = to_float(v.v[e]);
  }
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    lo += xv[i];
    hi += xv[16 + i];
  }
  *xlo = lo;
  *xhi = hi;
}

// ---------------------------------------------------------------- decode (GEMV) path

// Block (tile, 8 rows of I): warp w computes gate row j and up row j for the tile's pairs.
template <int QT>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_gate_up_kernel(QArgs a) {
  using B = Block<QT>;
  constexpr int kUnits = B::kWeights / 32;
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ int s_pair[kGemvRows];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  if (tid < rows) s_pair[tid] = a.sorted[a.tt.start[tile] + tid];
  __syncthreads();
  const int lane = tid % kWarp;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kGemvWarps + tid / kWarp;
  if (j >= a.inter) return;
  const int64_t H = a.hidden, I = a.inter, slot = a.expert_map[e];
  const uint8_t* gate = a.w13 + (slot * 2 * I + j) * a.rb13;
  const uint8_t* up = gate + I * a.rb13;
  float g[kGemvRows] = {}, u[kGemvRows] = {};
  for (int64_t gi = lane; gi < H / 32; gi += kWarp) {
    const int64_t boff = (gi / kUnits) * B::kBytes;
    const int unit = static_cast<int>(gi % kUnits);
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r < rows) {
        float xv[32], xlo, xhi;
        load32(a.x + static_cast<int64_t>(s_pair[r] / a.top_k) * H + gi * 32, xv, &xlo, &xhi);
        g[r] += gguf::dot32<QT>(gate + boff, unit, xv, xlo, xhi);
        u[r] += gguf::dot32<QT>(up + boff, unit, xv, xlo, xhi);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    if (r < rows) {
      const float gs = warp_sum(g[r]), us = warp_sum(u[r]);
      if (lane == 0) a.act[static_cast<int64_t>(s_pair[r]) * I + j] = from_float<bf16>(
          silu_mul(gs, us));
    }
  }
}

// Block (token, 8 rows of H): warp w computes out[t, h] = sum_k w_k * (w2_s[h] . act[pair]),
// walking the K * I/32 units flat so every lane has work.
template <int QT>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_down_kernel(QArgs a) {
  using B = Block<QT>;
  constexpr int kUnits = B::kWeights / 32;
  __shared__ int s_slot[moe_align::kMaxTopK];
  __shared__ float s_w[moe_align::kMaxTopK];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  if (tid < a.top_k) {
    const int64_t p = t * a.top_k + tid;
    s_slot[tid] = slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots);
    s_w[tid] = a.topk_w[p];
  }
  __syncthreads();
  const int lane = tid % kWarp;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kGemvWarps + tid / kWarp;
  if (h >= a.hidden) return;
  const int64_t I = a.inter, H = a.hidden, units = I / 32, total = a.top_k * units;
  float acc = 0.f;
  for (int64_t f = lane; f < total; f += kWarp) {
    const int k = static_cast<int>(f / units);
    const int64_t gi = f - k * units;
    const int64_t s = s_slot[k];
    if (s < 0) continue;
    const uint8_t* row = a.w2 + (s * H + h) * a.rb2 + (gi / kUnits) * B::kBytes;
    float xv[32], xlo, xhi;
    load32(a.act + (t * a.top_k + k) * I + gi * 32, xv, &xlo, &xhi);
    acc += s_w[k] * gguf::dot32<QT>(row, static_cast<int>(gi % kUnits), xv, xlo, xhi);
  }
  acc = warp_sum(acc);
  if (lane == 0) a.out[t * H + h] = from_float<bf16>(acc);
}

// ---------------------------------------------------------------- prefill (tiled) path

// Block (tile, 64 columns of I): C = x rows @ [gate rows | up rows]^T, act = silu(gate) * up.
template <int QT>
__global__ void __launch_bounds__(kThreads) tile_gate_up_kernel(QArgs a) {
  constexpr int BN = 128;
  using L = Layout<BN>;
  static_assert(BN == kThreads, "one B row offset per thread");
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ __attribute__((aligned(128))) unsigned char smem[L::kBytes];
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  const int64_t H = a.hidden, I = a.inter, j0 = static_cast<int64_t>(blockIdx.y) * 64;
  const int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    const int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? static_cast<int64_t>(pair / a.top_k) * H : -1;
  }
  {
    const int64_t j = j0 + tid % 64;  // tid < 64: gate row j, else up row j
    s_brow[tid] = j < I ? (slot * 2 * I + (tid < 64 ? j : I + j)) * a.rb13 : -1;
  }
  __syncthreads();
  moe_gguf_tile::tile_gemm<QT, BN>(smem, a.x, s_arow, a.w13, s_brow, H);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * 64; idx += kThreads) {
    const int r = idx / 64, n = idx % 64;
    if (r < rows && j0 + n < I) {
      const float v = silu_mul(C[r * L::kLdc + n], C[r * L::kLdc + 64 + n]);
      a.act[static_cast<int64_t>(s_pair[r]) * I + j0 + n] = from_float<bf16>(v);
    }
  }
}

// Block (tile, 64 columns of the chunk [c0, c0 + cw) of H): y[pair, n] = act[pair] . w2_s[c0 + n].
template <int QT>
__global__ void __launch_bounds__(kThreads) tile_down_kernel(QArgs a, int64_t c0, int64_t cw) {
  constexpr int BN = 64;
  using L = Layout<BN>;
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ __attribute__((aligned(128))) unsigned char smem[L::kBytes];
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  const int64_t I = a.inter, n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    const int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? pair * I : -1;
  }
  if (tid < BN) s_brow[tid] = n0 + tid < cw ? (slot * a.hidden + c0 + n0 + tid) * a.rb2 : -1;
  __syncthreads();
  moe_gguf_tile::tile_gemm<QT, BN>(smem, a.act, s_arow, a.w2, s_brow, I);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * BN; idx += kThreads) {
    const int r = idx / BN, n = idx % BN;
    if (r < rows && n0 + n < cw) a.y[s_pair[r] * a.y_cols + n0 + n] = C[r * L::kLdc + n];
  }
}

// out[t, c0 + c] = sum_k w[t,k] * y[t * K + k, c] in k order (pairs without a slot skipped).
__global__ void combine_kernel(QArgs a, int64_t c0, int64_t cw) {
  const int64_t total = static_cast<int64_t>(a.tokens) * cw;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t t = i / cw, c = i - t * cw;
    float acc = 0.f;
    for (int k = 0; k < a.top_k; ++k) {
      const int64_t p = t * a.top_k + k;
      if (slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots) >= 0)
        acc += a.topk_w[p] * a.y[p * a.y_cols + c];
    }
    a.out[t * a.hidden + c0 + c] = from_float<bf16>(acc);
  }
}

}  // namespace moe_gguf
}  // namespace freetoken
