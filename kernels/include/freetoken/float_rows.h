// Float weight rows (f32, f16 or bf16: GGML type ids 0, 1, 30; FP8 e4m3 with its block scales)
// against f32 activation rows: out[m * ldo + n] = x row m . weight row n, accumulated in f32. Compiled twice (see
// float_rows_body.h): for AVX2 + FMA + F16C, chosen where quant::best_isa() is avx2 or better,
// and for baseline x86-64.
//
// A tile of 4 weight rows x 2 activation rows loads each weight vector once for both rows and
// each activation vector once for the 4 weight rows; its 8 accumulators and the loads fit the
// 16 AVX2 registers. Decode (one activation row) is bound by reading the weights.
#pragma once

#include <immintrin.h>

#include <algorithm>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace floatrows {

constexpr int64_t kF32 = 0, kF16 = 1, kBF16 = 30;
// FP8 e4m3fn codes. GGML has no FP8 type: this id is FreeToken's own, outside GGML's range.
constexpr int64_t kE4M3 = 1000;

/*! \brief Bytes of one element of a float weight type, 0 for any other type id. */
inline int64_t element_bytes(int64_t wtype) {
  return wtype == kF32 ? 4 : (wtype == kF16 || wtype == kBF16) ? 2 : wtype == kE4M3 ? 1 : 0;
}

/*!
 * \brief The scales of FP8 weight rows (models/quant/scaled.py's rule). Row n of a float_rows
 * call is row row0 + n of its matrix, and W[n, j] = e4m3(code) * grid[((row0 + n) / bn) *
 * grid_cols + j / bk] * (row_scale ? row_scale[row0 + n] : 1). bk is a multiple of 8 or spans
 * the row.
 */
struct BlockScales {
  const float* grid = nullptr;
  int64_t grid_cols = 1, bn = 1, bk = 1;
  const float* row_scale = nullptr;
  int64_t row0 = 0;
};

/*! \brief An e4m3 code's bits as an IEEE half of 1/256 of its value: the exponent bias moves
 * from 7 to 15 by the shift alone, exact for normals and subnormals (the GPU kernels decode
 * the same way: scaled_decode.cuh). */
inline uint16_t e4m3_half_bits(uint8_t code) {
  return static_cast<uint16_t>(((code & 0x80) << 8) | ((code & 0x7F) << 7));
}
constexpr float kE4M3HalfScale = 256.f;

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
 * FP8 weights (kE4M3) need `scales` and k a multiple of 8. simd: the AVX2/FMA/F16C build (the
 * caller checked the CPU has them).
 */
inline void float_rows(bool simd, const uint8_t* w, int64_t row_bytes, int64_t wtype, int64_t n0,
                       int64_t n1, const float* x, int64_t ldx, int64_t rows, int64_t k,
                       float* out, int64_t ldo, const BlockScales* scales = nullptr) {
  if (simd) {
    avx2::float_rows(w, row_bytes, wtype, n0, n1, x, ldx, rows, k, out, ldo, scales);
  } else {
    baseline::float_rows(w, row_bytes, wtype, n0, n1, x, ldx, rows, k, out, ldo, scales);
  }
}

/*!
 * \brief out[M, N] = x[M, K] @ W[N, K].T over the kernels' thread pool: tasks of (a block of x
 * rows, a chunk of weight rows) sized so decode splits the weights and a longer x its rows too.
 */
inline void float_matmul_pool(bool simd, const uint8_t* w, int64_t row_bytes, int64_t wtype,
                              int64_t n, const float* x, int64_t m, int64_t k, float* out,
                              const BlockScales* scales = nullptr) {
  // Weight bytes a chunk holds at least: fewer chunks than that cost more in hand-offs than
  // they gain in balance (as quant_gemm's decode chunks).
  constexpr int64_t kChunkBytes = 65536;
  const int64_t threads = thread_pool().num_threads();
  const int64_t chunks = std::clamp<int64_t>(n * row_bytes / kChunkBytes, 1, threads * 8);
  // whole tiles of 4 weight rows
  const int64_t grain = (std::max<int64_t>(4, (n + chunks - 1) / chunks) + 3) / 4 * 4;
  const int64_t n_tasks = (n + grain - 1) / grain;
  // x rows per task: about 4 tasks a thread, at least 8, even (float_rows takes 2 at a time)
  const int64_t rows_per_task = (m + threads * 4 - 1) / (threads * 4);
  const int64_t m_grain = std::max<int64_t>(8, (rows_per_task + 1) / 2 * 2);
  const int64_t m_tasks = (m + m_grain - 1) / m_grain;
  parallel_for(m_tasks * n_tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / n_tasks * m_grain, m1 = std::min(m, m0 + m_grain);
      const int64_t n0 = t % n_tasks * grain, n1 = std::min(n, n0 + grain);
      float_rows(simd, w, row_bytes, wtype, n0, n1, x + m0 * k, k, m1 - m0, k, out + m0 * n, n,
                 scales);
    }
  });
}

}  // namespace floatrows
}  // namespace freetoken
