// MoE routing of one token by one warp: softmax over its E router logits in f32, then K rounds
// of a warp argmax (ties: the lower id), optionally renormalised over the K picked. Shared by
// moe.cu's moe_topk_softmax and moe_decode's gate/up (which routes in its prologue), so both
// give the same ids and the same weight bits.
#pragma once

#include "freetoken/cuda_common.cuh"

namespace freetoken {

constexpr int kRouteMaxExperts = 16 * kWarp;  // 16 logits per lane in registers

/*! \brief Lane k < top_k gets the token's k-th pick: its weight and expert id. */
template <typename L>
__device__ __forceinline__ void route_row(const L* row, int experts, int top_k,
                                          bool renormalize, float* weight, int* id) {
  constexpr float kNoLogit = -__builtin_huge_valf();
  int lane = threadIdx.x % kWarp;
  float v[kRouteMaxExperts / kWarp];
  float m = kNoLogit;
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
    int e = lane + j * kWarp;
    v[j] = e < experts ? to_float(row[e]) : kNoLogit;
    m = v[j] > m ? v[j] : m;
  }
  m = warp_max(m);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
    v[j] = lane + j * kWarp < experts ? __expf(v[j] - m) : 0.f;
    sum += v[j];
  }
  float inv = 1.f / warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j)
    v[j] = lane + j * kWarp < experts ? v[j] * inv : -1.f;  // -1: never selected
  float my_w = 0.f, picked = 0.f;
  int my_id = 0;
  for (int k = 0; k < top_k; ++k) {
    float best = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
      if (v[j] > best) {  // strict: the lower id wins a tie within the lane
        best = v[j];
        bi = lane + j * kWarp;
      }
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      float ob = __shfl_xor_sync(0xffffffffu, best, off);
      int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == k) {
      my_w = best;
      my_id = bi;
    }
    picked += best;
#pragma unroll
    for (int j = 0; j < kRouteMaxExperts / kWarp; ++j)
      if (lane + j * kWarp == bi) v[j] = -1.f;
  }
  *weight = renormalize ? my_w / picked : my_w;
  *id = my_id;
}

}  // namespace freetoken
