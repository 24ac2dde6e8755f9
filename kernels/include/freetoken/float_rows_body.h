// The float-weight row product, written once and compiled once per ISA (see float_rows.h).
//
// No include guard on purpose: float_rows.h includes this file once per ISA, each time with
//   FT_FR_NS      the namespace to define (avx2, baseline)
//   FT_FR_ATTR    the attributes of every function here (a GCC target for avx2, none otherwise)
//   FT_FR_SIMD    1 to use F16C / FMA intrinsics, 0 for portable code
// NOTE: every function carries FT_FR_ATTR: GCC refuses to inline a target's intrinsics into a
// function without that target, even one that is itself always inlined into such a function.

#define FT_FR_INLINE FT_FR_ATTR __attribute__((always_inline)) inline

namespace FT_FR_NS {

// Eight weights from `p` as floats.
template <int64_t WT>
FT_FR_INLINE v8f load_weights8(const uint8_t* p) {
  if constexpr (WT == kF32) {
    return load8(reinterpret_cast<const float*>(p));
  } else {
#if FT_FR_SIMD
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (WT == kF16) return (v8f)_mm256_cvtph_ps(h);
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
    uint16_t h[8];
    std::memcpy(h, p, sizeof(h));
    v8f v;
    for (int l = 0; l < 8; ++l) v[l] = WT == kF16 ? f16_to_float(h[l]) : bf16_to_float(h[l]);
    return v;
#endif
  }
}

// Eight e4m3 codes from `p` as floats of 1/256 of their values (e4m3_half_bits).
FT_FR_INLINE v8f load_e4m3x8(const uint8_t* p) {
#if FT_FR_SIMD
  // Sign-extended to 16 bits and shifted left by 7, a code's bits land where a half keeps
  // them; a negative code's extension also sets bit 14 (the half exponent's top bit), cleared.
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return (v8f)_mm256_cvtph_ps(h);
#else
  v8f v;
  for (int l = 0; l < 8; ++l) v[l] = f16_to_float(e4m3_half_bits(p[l]));
  return v;
#endif
}

FT_FR_INLINE v8f fma8(const v8f& a, const v8f& b, const v8f& c) {
#if FT_FR_SIMD
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/*! \brief out[(m + r) * ldo + n + i] for weight rows n..n+NR and activation rows m..m+MR. */
template <int64_t WT, int NR, int MR>
FT_FR_INLINE void float_tile(const uint8_t* w, int64_t row_bytes, int64_t n, const float* x,
                             int64_t ldx, int64_t m, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t kBytes = WT == kF32 ? 4 : 2;
  const uint8_t* rows[NR];
  v8f acc[NR][MR];
  for (int i = 0; i < NR; ++i) {
    rows[i] = w + (n + i) * row_bytes;
    for (int r = 0; r < MR; ++r) acc[i][r] = v8f{};
  }
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    v8f xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = load8(x + (m + r) * ldx + j);
    for (int i = 0; i < NR; ++i) {
      const v8f wv = load_weights8<WT>(rows[i] + j * kBytes);
      for (int r = 0; r < MR; ++r) acc[i][r] = fma8(wv, xv[r], acc[i][r]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int r = 0; r < MR; ++r) {
      float sum = hsum8(acc[i][r]);
      for (int64_t t = j; t < k; ++t) sum += weight_at<WT>(rows[i] + t * kBytes) * x[(m + r) * ldx + t];
      out[(m + r) * ldo + n + i] = sum;
    }
  }
}

/*! \brief float_tile over FP8 rows (k and the blocks multiples of 8); the row scale applies to
 * the sum. One activation row (decode) sums each block apart and scales the sum (NR partial
 * accumulators); several rows scale each 8 decoded weights once for all of them, so the
 * accumulators, activations and scales of a 4 x 2 or 2 x 4 tile fit the 16 AVX2 registers. */
template <int NR, int MR>
FT_FR_INLINE void e4m3_tile(const uint8_t* w, int64_t row_bytes, int64_t n, const float* x,
                            int64_t ldx, int64_t m, int64_t k, float* out, int64_t ldo,
                            const BlockScales& s) {
  const uint8_t* rows[NR];
  const float* grid[NR];
  v8f acc[NR][MR];
  for (int i = 0; i < NR; ++i) {
    rows[i] = w + (n + i) * row_bytes;
    grid[i] = s.grid + (s.row0 + n + i) / s.bn * s.grid_cols;
    for (int r = 0; r < MR; ++r) acc[i][r] = v8f{};
  }
  for (int64_t j0 = 0, block = 0; j0 < k; j0 += s.bk, ++block) {
    v8f scale[NR];
    for (int i = 0; i < NR; ++i) scale[i] = v8f{} + grid[i][block] * kE4M3HalfScale;
    const int64_t j1 = std::min(k, j0 + s.bk);
    if constexpr (MR == 1) {
      v8f part[NR];
      for (int i = 0; i < NR; ++i) part[i] = v8f{};
      for (int64_t j = j0; j < j1; j += 8) {
        const v8f xv = load8(x + m * ldx + j);
        for (int i = 0; i < NR; ++i) part[i] = fma8(load_e4m3x8(rows[i] + j), xv, part[i]);
      }
      for (int i = 0; i < NR; ++i) acc[i][0] = fma8(part[i], scale[i], acc[i][0]);
    } else {
      for (int64_t j = j0; j < j1; j += 8) {
        v8f xv[MR];
        for (int r = 0; r < MR; ++r) xv[r] = load8(x + (m + r) * ldx + j);
        for (int i = 0; i < NR; ++i) {
          const v8f wv = load_e4m3x8(rows[i] + j) * scale[i];
          for (int r = 0; r < MR; ++r) acc[i][r] = fma8(wv, xv[r], acc[i][r]);
        }
      }
    }
  }
  for (int i = 0; i < NR; ++i) {
    const float row_scale = s.row_scale != nullptr ? s.row_scale[s.row0 + n + i] : 1.f;
    for (int r = 0; r < MR; ++r) out[(m + r) * ldo + n + i] = hsum8(acc[i][r]) * row_scale;
  }
}

template <int NR, int MR>
FT_FR_INLINE void e4m3_row_tiles(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                 const float* x, int64_t ldx, int64_t m, int64_t k, float* out,
                                 int64_t ldo, const BlockScales& s) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) e4m3_tile<NR, MR>(w, row_bytes, n, x, ldx, m, k, out, ldo, s);
  for (; n < n1; ++n) e4m3_tile<1, MR>(w, row_bytes, n, x, ldx, m, k, out, ldo, s);
}

/*! \brief Every activation row against weight rows [n0, n1): 2 x 4 tiles while 4 rows are
 * left (each weight vector decoded once for four rows), then 4 x 2, then 4 x 1. */
FT_FR_INLINE void e4m3_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                            const float* x, int64_t ldx, int64_t rows, int64_t k, float* out,
                            int64_t ldo, const BlockScales& s) {
  int64_t m = 0;
  for (; m + 4 <= rows; m += 4) e4m3_row_tiles<2, 4>(w, row_bytes, n0, n1, x, ldx, m, k, out, ldo, s);
  for (; m + 2 <= rows; m += 2) e4m3_row_tiles<4, 2>(w, row_bytes, n0, n1, x, ldx, m, k, out, ldo, s);
  if (m < rows) e4m3_row_tiles<4, 1>(w, row_bytes, n0, n1, x, ldx, m, k, out, ldo, s);
}

template <int64_t WT, int MR>
FT_FR_INLINE void float_row_tiles(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                  const float* x, int64_t ldx, int64_t m, int64_t k, float* out,
                                  int64_t ldo) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) float_tile<WT, 4, MR>(w, row_bytes, n, x, ldx, m, k, out, ldo);
  for (; n < n1; ++n) float_tile<WT, 1, MR>(w, row_bytes, n, x, ldx, m, k, out, ldo);
}

template <int64_t WT>
FT_FR_INLINE void float_rows_typed(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                   const float* x, int64_t ldx, int64_t rows, int64_t k,
                                   float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 2 <= rows; m += 2) float_row_tiles<WT, 2>(w, row_bytes, n0, n1, x, ldx, m, k, out, ldo);
  if (m < rows) float_row_tiles<WT, 1>(w, row_bytes, n0, n1, x, ldx, m, k, out, ldo);
}

/*! \brief See floatrows::float_rows. */
FT_FR_ATTR inline void float_rows(const uint8_t* w, int64_t row_bytes, int64_t wtype, int64_t n0,
                                  int64_t n1, const float* x, int64_t ldx, int64_t rows,
                                  int64_t k, float* out, int64_t ldo, const BlockScales* scales) {
  if (wtype == kE4M3) {
    e4m3_rows(w, row_bytes, n0, n1, x, ldx, rows, k, out, ldo, *scales);
    return;
  }
  if (wtype == kF32) float_rows_typed<kF32>(w, row_bytes, n0, n1, x, ldx, rows, k, out, ldo);
  if (wtype == kF16) float_rows_typed<kF16>(w, row_bytes, n0, n1, x, ldx, rows, k, out, ldo);
  if (wtype == kBF16) float_rows_typed<kBF16>(w, row_bytes, n0, n1, x, ldx, rows, k, out, ldo);
}

}  // namespace FT_FR_NS

#undef FT_FR_INLINE
