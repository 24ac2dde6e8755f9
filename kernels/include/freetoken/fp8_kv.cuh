// The FP8 KV pool on the GPU (freetoken/fp8_encode.h has its format): the warp that writes one
// (token, KV head) row, shared by store_kv_fp8 (kv_cache.cu) and rope_store_kv_fp8 (rope_kv.cu),
// and the check of its scale arrays, shared with paged_attention_fp8 (attention.cu).
#pragma once

#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_encode.h"

namespace freetoken {
namespace fp8 {

/*! \brief One warp: scale = largest |x| / 448, code = e4m3(x / scale) for a row of head_dim. */
template <typename T>
__device__ __forceinline__ void store_row(const T* src, uint8_t* codes, float* scale,
                                          int head_dim, int lane) {
  float amax = 0.f;
  for (int d = lane; d < head_dim; d += kWarp) amax = fmaxf(amax, fabsf(to_float(src[d])));
  const float s = row_scale(warp_max(amax));
  for (int d = lane; d < head_dim; d += kWarp) codes[d] = float_to_e4m3(to_float(src[d]) / s);
  if (lane == 0) *scale = s;
}

/*! \brief A pool's scales: float32 [S, Hk] on the codes' GPU, one per (slot, KV head). */
inline void check_scales(const TensorView& t, const TensorView& codes, const char* name) {
  check_gpu(t, name, codes.device().device_id);
  check_dtype(t, kDLFloat, 32, name, "float32");
  check_contiguous(t, name);
  TVM_FFI_ICHECK(t.ndim() == 2 && t.size(0) == codes.size(0) && t.size(1) == codes.size(1))
      << name << " must be [" << codes.size(0) << ", " << codes.size(1)
      << "] (one scale per slot and KV head)";
}

}  // namespace fp8
}  // namespace freetoken
