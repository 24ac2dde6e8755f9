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

constexpr int kScaledFp8 = 0;    // the `fmt` argument of the scaled kernels
constexpr int kScaledNvfp4 = 1;
constexpr int kScaledChunk = 16;  // values decoded together: one e4m3 scale covers them

/*! \brief Where a scaled weight's scales live: W[r, c] = value * grid[r / bn][c / bk] *
 * row_scale[r]. FP8: a float32 grid; NVFP4: e4m3 bytes [rows, cols / 16] (bn 1, bk 16). */
struct ScaleGrid {
  const void* scales;
  const float* row_scale;
  int bn, bk, cols;  // rows and columns one scale covers; grid columns
};

/*! \brief 16 activations from 16-byte aligned memory, as float. */
template <typename T>
__device__ __forceinline__ void load_x16(const T* p, float (&v)[kScaledChunk]) {
  constexpr int kPer = 16 / sizeof(T);
#pragma unroll
  for (int part = 0; part < kScaledChunk / kPer; ++part) {
    Vec<T, kPer> x = load_vec<T, kPer>(p + part * kPer);
#pragma unroll
    for (int e = 0; e < kPer; ++e) v[part * kPer + e] = to_float(x.v[e]);
  }
}

/*! \brief The 16 weights of row `row` from column `col` (a multiple of 16; `wrow` points at
 * the row's bytes), decoded into `w`, and the block scale they share (row_scale not applied). */
template <int FMT>
__device__ __forceinline__ float scaled_decode16(const uint8_t* wrow, int row, int col,
                                                 const ScaleGrid& g, float (&w)[kScaledChunk]) {
  if constexpr (FMT == kScaledFp8) {
    Vec<uint32_t, 4> q = load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(wrow + col));
#pragma unroll
    for (int i = 0; i < kScaledChunk; ++i)
      w[i] = e4m3_to_float((q.v[i / 4] >> (8 * (i % 4))) & 0xFFu);
    const float* grid = static_cast<const float*>(g.scales);
    return grid[static_cast<int64_t>(row / g.bn) * g.cols + col / g.bk];
  } else {
    Vec<uint32_t, 2> q =
        load_vec<uint32_t, 2>(reinterpret_cast<const uint32_t*>(wrow + col / 2));
#pragma unroll
    for (int i = 0; i < kScaledChunk; ++i)
      w[i] = e2m1_to_float((q.v[i / 8] >> (4 * (i % 8))) & 0xFu);
    const uint8_t* grid = static_cast<const uint8_t*>(g.scales);
    return e4m3_to_float(grid[static_cast<int64_t>(row) * g.cols + col / kScaledChunk]);
  }
}

}  // namespace freetoken
