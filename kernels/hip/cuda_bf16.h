// HIP stand-in for <cuda_bf16.h>: bfloat16 as raw bits with round-to-nearest-even conversion
// (integer code only, so no backend bf16 arithmetic support is needed).
#pragma once
#include "hip_shim.h"

struct __nv_bfloat16 {
  unsigned short x;
};

__host__ __device__ inline float __bfloat162float(__nv_bfloat16 h) {
  return __builtin_bit_cast(float, static_cast<unsigned int>(h.x) << 16);
}

__host__ __device__ inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  unsigned int u = __builtin_bit_cast(unsigned int, f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {static_cast<unsigned short>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<unsigned short>(u >> 16)};
}

__host__ __device__ inline __nv_bfloat16 __float2bfloat16(float f) {
  return __float2bfloat16_rn(f);
}
