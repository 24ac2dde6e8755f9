// FP8 e4m3 bytes to float four at a time (one 32-bit word of weight bytes), shared by the
// decode GEMV (kernels/cuda/quant_gemv.cu) and a host build that tests it against torch's
// float8 conversion (tests/kernel/test_quant_gemv_host.py).
//
// Each pair of bytes becomes a pair of IEEE halves in one 32-bit word: sign to bit 15, the
// exponent and mantissa bits to bits 13..7, i.e. the e4m3 value divided by 2^8 (e4m3's bias is
// 7, a half's 15), exact for normals and subnormals. The caller multiplies the 2^8 back once
// per sum instead of once per weight. e4m3's NaN codes (0x7F, 0xFF) read as +-480: checkpoints
// never hold them.
#pragma once

#include <cstdint>

#include "freetoken/gguf_blocks.h"  // FT_GGUF_HD, the host half -> float

namespace freetoken {
namespace fp8 {

FT_GGUF_HD float half_bits(uint32_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
#elif defined(__HIP_DEVICE_COMPILE__)
  return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(h)));
#else
  return gguf::half_bits_to_float(h);
#endif
}

/*! \brief f[i] = e4m3 value of byte i of v, divided by 256. */
FT_GGUF_HD void e4m3x4_div256(uint32_t v, float* f) {
  const uint32_t lo = ((v << 8) & 0xFF00u) | ((v << 16) & 0xFF000000u);  // bytes 0, 1 high
  const uint32_t hi = ((v >> 8) & 0xFF00u) | (v & 0xFF000000u);          // bytes 2, 3 high
  const uint32_t hlo = (lo & 0x80008000u) | ((lo >> 1) & 0x3F803F80u);
  const uint32_t hhi = (hi & 0x80008000u) | ((hi >> 1) & 0x3F803F80u);
  f[0] = half_bits(hlo & 0xFFFFu);
  f[1] = half_bits(hlo >> 16);
  f[2] = half_bits(hhi & 0xFFFFu);
  f[3] = half_bits(hhi >> 16);
}

}  // namespace fp8
}  // namespace freetoken
