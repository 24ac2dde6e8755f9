// The x86 SIMD path for the K-quant super-blocks (Q4_K, Q5_K, Q6_K), included by
// quant_x86_body.h inside its per-ISA namespace (no include guard on purpose; see there).
//
// A super-block covers eight activation blocks of 32. Its scales are decoded once into per
// sub-block floats, then each sub-block is one integer dot product against its activation
// block, scaled per 16-weight half (Q6_K's scales change every 16 weights: the dot product's
// lanes 0..3 sum weights 0..15, lanes 4..7 weights 16..31). The Q4_K/Q5_K mins meet the
// activation block sums (sx) in one 8-lane FMA per super-block.

template <int64_t QT>
constexpr int64_t kq_bytes() {
  return QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : 210;
}

FT_QX_INLINE __m256i shift_right16(__m256i v, int bits) {
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits));
}

// Sub-block j's 32 weights as bytes: unsigned q (Q4_K, Q5_K) or signed q - 32 (Q6_K).
template <int64_t QT>
FT_QX_INLINE __m256i kq_weights(const uint8_t* sb, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (QT == kQ6_K) {
    const int half = j / 4, k = j % 4;
    __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 64 * half + 32 * (k & 1)));
    __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * half));
    __m256i lo = _mm256_and_si256(shift_right16(ql, 4 * (k >> 1)), low4);
    __m256i hi = _mm256_and_si256(_mm256_slli_epi16(shift_right16(qh, 2 * k), 4),
                                  _mm256_set1_epi8(0x30));
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  } else {
    const uint8_t* qs = sb + (QT == kQ5_K ? 48 : 16) + 32 * (j / 2);
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    q = _mm256_and_si256(shift_right16(q, 4 * (j % 2)), low4);
    if constexpr (QT == kQ5_K) {
      __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
      __m256i bit = _mm256_and_si256(_mm256_slli_epi16(shift_right16(qh, j), 4),
                                     _mm256_set1_epi8(0x10));
      q = _mm256_or_si256(q, bit);
    }
    return q;
  }
}

// Per sub-block: the scale of weights 0..15 (lo) and 16..31 (hi), and the offset (-dmin * m).
template <int64_t QT>
FT_QX_INLINE void kq_scales(const uint8_t* sb, float* lo, float* hi, float* offset) {
  if constexpr (QT == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192);
    const float d = half_at(sb + 208);
    for (int j = 0; j < 8; ++j) {
      const int at = 8 * (j / 4) + 2 * (j % 4);
      lo[j] = d * static_cast<float>(sc[at]);
      hi[j] = d * static_cast<float>(sc[at + 1]);
      offset[j] = 0.f;
    }
  } else {
    const float d = half_at(sb), dmin = half_at(sb + 2);
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      scale_min_k4(sb + 4, j, &sc, &m);
      lo[j] = hi[j] = d * static_cast<float>(sc);
      offset[j] = -dmin * static_cast<float>(m);
    }
  }
}

/*! \brief out[(m0 + r) * ldo + n] for weight row n (at `row`) and MR activation rows. */
template <int64_t QT, int MR>
FT_QX_INLINE void kquant_tile(const uint8_t* row, const QuantizedRows& xq, int64_t m0,
                              float* out, int64_t ldo, int64_t n) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t supers = xq.blocks / 8;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* sb = row + s * kq_bytes<QT>();
    alignas(32) float lo[8], hi[8], offset[8];
    kq_scales<QT>(sb, lo, hi, offset);
    if constexpr (QT != kQ6_K) {
      const __m256 off = _mm256_load_ps(offset);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(off, _mm256_loadu_ps(xq.s_row(m0 + r) + s * 8), acc[r]);
      }
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i w = kq_weights<QT>(sb, j);
      const __m256i w_abs = QT == kQ6_K ? _mm256_abs_epi8(w) : w;
      const __m256 scale = _mm256_set_m128(_mm_set1_ps(hi[j]), _mm_set1_ps(lo[j]));
      const int64_t b = s * 8 + j;
      for (int r = 0; r < MR; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q_row(m0 + r) + b * kBlock));
        if constexpr (QT == kQ6_K) x = _mm256_sign_epi8(x, w);  // signed x signed, as Q8_0
        const __m256 dot = dot_u8_i8(w_abs, x);
        const __m256 dx = _mm256_broadcast_ss(xq.d_row(m0 + r) + b);
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) out[(m0 + r) * ldo + n] = hsum(acc[r]);
}

template <int64_t QT>
FT_QX_FN void kquant_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                          const QuantizedRows& xq, float* out, int64_t ldo) {
  const int64_t ahead_rows = (kPrefetchBytes + row_bytes - 1) / row_bytes;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    if (xq.rows == 1 && n + ahead_rows < ldo) {  // decode: as matmul_tile's prefetch
      const char* ahead = reinterpret_cast<const char*>(row + ahead_rows * row_bytes);
      for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    int64_t m0 = 0;
    for (; m0 + 4 <= xq.rows; m0 += 4) kquant_tile<QT, 4>(row, xq, m0, out, ldo, n);
    switch (xq.rows - m0) {
      case 3: kquant_tile<QT, 3>(row, xq, m0, out, ldo, n); break;
      case 2: kquant_tile<QT, 2>(row, xq, m0, out, ldo, n); break;
      case 1: kquant_tile<QT, 1>(row, xq, m0, out, ldo, n); break;
      default: break;
    }
  }
}
