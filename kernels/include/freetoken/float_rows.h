// Float weight rows (f32, f16 or bf16: GGML type ids 0, 1, 30) against f32 activation rows:
// out[m * ldo + n] = x row m . weight row n, accumulated in f32. Compiled twice (see
// float_rows_body.h): for AVX2 + FMA + F16C, chosen where quant::best_isa() is avx2 or better,
// and for baseline x86-64.
//
// A tile of 4 weight rows x 2 activation rows loads each weight vector once for both rows and
// each activation vector once for the 4 weight rows; its 8 accumulators and the loads fit the
// 16 AVX2 registers. Decode (one activation row) is bound by reading the weights.
#pragma once

#include <immintrin.h>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace floatrows {

constexpr int64_t kF32 = 0, kF16 = 1, kBF16 = 30;

/*! \brief Bytes of one element of a float weight type, 0 for any other type id. */
inline int64_t element_bytes(int64_t wtype) {
  return wtype == kF32 ? 4 : (wtype == kF16 || wtype == kBF16) ? 2 : 0;
}

template <int64_t WT>
inline __attribute__((always_inline)) float weight_at(const uint8_t* p) {
  if constexpr (WT == kF32) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return WT == kF16 ? f16_to_float(h) : bf16_to_float(h);
}

#define FT_FR_NS avx2
#define FT_FR_ATTR __attribute__((target("avx2,fma,f16c")))
#define FT_FR_SIMD 1
#include "freetoken/float_rows_body.h"
#undef FT_FR_NS
#undef FT_FR_ATTR
#undef FT_FR_SIMD

#define FT_FR_NS baseline
#define FT_FR_ATTR
#define FT_FR_SIMD 0
#include "freetoken/float_rows_body.h"
#undef FT_FR_NS
#undef FT_FR_ATTR
#undef FT_FR_SIMD

/*!
 * \brief out[m * ldo + n] = x row m . weight row n for m in [0, rows), n in [n0, n1); weight row
 * n starts at w + n * row_bytes and holds k elements of `wtype`; x rows are ldx floats apart.
 * simd: the AVX2/FMA/F16C build (the caller checked the CPU has them).
 */
inline void float_rows(bool simd, const uint8_t* w, int64_t row_bytes, int64_t wtype, int64_t n0,
                       int64_t n1, const float* x, int64_t ldx, int64_t rows, int64_t k,
                       float* out, int64_t ldo) {
  if (simd) {
    avx2::float_rows(w, row_bytes, wtype, n0, n1, x, ldx, rows, k, out, ldo);
  } else {
    baseline::float_rows(w, row_bytes, wtype, n0, n1, x, ldx, rows, k, out, ldo);
  }
}

}  // namespace floatrows
}  // namespace freetoken
