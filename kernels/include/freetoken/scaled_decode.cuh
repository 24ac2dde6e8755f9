// FP8 e4m3 and FP4 e2m1 codes to float, through a half-precision bit pattern: both formats are
// the top bits of an IEEE half with a smaller exponent bias, so placing the code's bits in a
// half and multiplying by 2^(15 - bias) is exact for every normal and subnormal value (the
// half->float conversion handles the subnormals; no flush-to-zero is involved). e4m3's NaN
// code (0x7F) decodes as 480: checkpoints never hold it. tests/kernel/test_scaled_decode.py
// checks the same bit mapping against torch's float8 conversion for every code.
#pragma once

#include <cstdint>

#include "freetoken/cuda_common.cuh"

namespace freetoken {

__device__ __forceinline__ float half_bits_to_float(uint32_t bits) {
#if defined(__HIP_PLATFORM_AMD__)
  return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(bits)));
#else
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
#endif
}

/*! \brief e4m3fn byte -> float: sign to bit 15, exponent and mantissa to bits 13..7. */
__device__ __forceinline__ float e4m3_to_float(uint32_t code) {
  return half_bits_to_float(((code & 0x80u) << 8) | ((code & 0x7Fu) << 7)) * 256.0f;
}

/*! \brief e2m1 nibble -> float: sign to bit 15, exponent and mantissa to bits 11..9. */
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
  return half_bits_to_float(((code & 0x8u) << 12) | ((code & 0x7u) << 9)) * 16384.0f;
}

}  // namespace freetoken
