// HIP stand-in for <cuda_fp16.h>: __half is the compiler's _Float16 on host and device.
#pragma once
#include "hip_shim.h"

typedef _Float16 __half;

__host__ __device__ inline float __half2float(__half h) { return static_cast<float>(h); }
__host__ __device__ inline __half __float2half(float f) { return static_cast<__half>(f); }
__host__ __device__ inline __half __float2half_rn(float f) { return static_cast<__half>(f); }
