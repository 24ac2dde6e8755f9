// Float to FP8 e4m3fn (round to nearest even, saturating at +-448) and the per-(token, head)
// scale of the FP8 KV pool, for the host and the device alike: the CPU and GPU KV writers
// must store the same bytes for the same rows.
//
// The FP8 KV pool: K and V are uint8 [S, Hk, D] holding e4m3fn codes, and beside each a float32
// scale [S, Hk]; a row's values are code * scale. A row's scale is its largest magnitude / 448
// (1 for an all-zero row), fixed when the token is written, so rollback and prefix sharing read
// exactly what was written.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "freetoken/gguf_blocks.h"  // FT_GGUF_HD

namespace freetoken {
namespace fp8 {

constexpr float kE4M3Max = 448.f;

FT_GGUF_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(uint32_t, f);  // std::memcpy is host-only under HIP
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FT_GGUF_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(float, u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

FT_GGUF_HD float round_even(float x) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  return rintf(x);
#else
  return std::nearbyint(x);  // the default rounding mode: to nearest, ties to even
#endif
}

/*! \brief The e4m3fn code nearest to f (ties to even); +-448 beyond it, 0x7F/0xFF for NaN. */
FT_GGUF_HD uint8_t float_to_e4m3(float f) {
  const uint32_t bits = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | 0x7Fu;              // NaN
  if (abs_bits >= 0x43E80000u) return sign | 0x7Eu;             // >= 464 (and inf): saturate
  if (abs_bits < 0x3C800000u) {                                 // below 2^-6: subnormal steps
    // multiples of 2^-9; 8 of them is the smallest normal, whose code is 8 as well
    return sign | static_cast<uint8_t>(round_even(bits_float(abs_bits) * 512.f));
  }
  // normal: round the 23-bit mantissa to 3 bits, ties to even; a carry moves the exponent
  const uint32_t rounded = abs_bits + 0x7FFFFu + ((abs_bits >> 20) & 1u);
  const int exponent = static_cast<int>(rounded >> 23) - 127 + 7;
  const uint32_t code = (static_cast<uint32_t>(exponent) << 3) | ((rounded >> 20) & 7u);
  return sign | static_cast<uint8_t>(code > 0x7Eu ? 0x7Eu : code);
}

/*! \brief The scale a row of largest magnitude `amax` is stored with. */
FT_GGUF_HD float row_scale(float amax) { return amax > 0.f ? amax / kE4M3Max : 1.f; }

}  // namespace fp8
}  // namespace freetoken
