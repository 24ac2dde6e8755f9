// The x86 SIMD path for the K-quant super-blocks (Q4_K, Q5_K, Q6_K), included by
// quant_x86_body.h inside its per-ISA namespace (no include guard on purpose; see there).
//
// The activations share one scale per super-block (activation_group), so a super-block's sum
// stays in integers: each sub-block's byte products are summed in pairs to int16 (maddubs),
// multiplied by its integer scale and summed to int32 in one step (madd, or vpdpwssd), and one
// convert and one FMA by d * dx finish the super-block. Q6_K's scales change every 16 weights:
// the int16 lanes 0..7 hold weights 0..15, lanes 8..15 weights 16..31, so the scale vector
// carries the two scales in its two halves. The Q4_K/Q5_K mins meet the activation block sums
// (sx) in one 8-lane FMA per super-block.

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

/*!
 * \brief The super-block's integer scales as bytes (Q4_K/Q5_K: the 8 6-bit scales; Q6_K: the
 * 16 int8 scales) and, for Q4_K/Q5_K, the 8 sub-blocks' offsets -dmin * m as floats.
 * The 12 packed bytes unpack four at a time (ggml's get_scale_min_k4 on 32-bit words).
 */
template <int64_t QT>
FT_QX_INLINE __m128i kq_scale_bytes(const uint8_t* sb, __m256* offset) {
  if constexpr (QT == kQ6_K) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192));
  } else {
    uint32_t u[3];
    std::memcpy(u, sb + 4, 12);
    const uint32_t six = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
    const uint32_t sc_lo = u[0] & six;
    const uint32_t sc_hi = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    const uint32_t m_lo = u[1] & six;
    const uint32_t m_hi = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
        _mm_setr_epi32(static_cast<int>(m_lo), static_cast<int>(m_hi), 0, 0)));
    *offset = _mm256_mul_ps(mins, _mm256_set1_ps(-half_to_float(sb + 2)));
    return _mm_setr_epi32(static_cast<int>(sc_lo), static_cast<int>(sc_hi), 0, 0);
  }
}

// Sub-block j's scale for each int16 product lane: Q4_K/Q5_K byte j everywhere; Q6_K byte 2j
// for lanes 0..7 (weights 0..15) and byte 2j + 1 for lanes 8..15.
template <int64_t QT>
FT_QX_INLINE __m256i kq_scale_lanes(__m128i bytes, int j) {
  const __m128i pick = QT == kQ6_K
      ? _mm_setr_epi8(2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1,
                      2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1)
      : _mm_set1_epi8(static_cast<char>(j));
  return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(bytes, pick));
}

// acc + (w . x summed in pairs) * scale, summed again in pairs to int32 lanes. A pair sum is at
// most 2 * 32 * 127 in magnitude (Q6_K's |q - 32| <= 32, Q5_K's q <= 31): no int16 saturation.
FT_QX_INLINE __m256i scaled_dot(__m256i acc, __m256i w, __m256i x, __m256i scale) {
  const __m256i pairs = _mm256_maddubs_epi16(w, x);
#if FT_QX_VNNI
  return _mm256_dpwssd_epi32(acc, pairs, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale));
#endif
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
    __m256 offset;
    const __m128i scale_bytes = kq_scale_bytes<QT>(sb, &offset);
    if constexpr (QT != kQ6_K) {
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(xq.s_row(m0 + r) + s * 8), acc[r]);
      }
    }
    __m256i sum[MR];
    for (int r = 0; r < MR; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i w = kq_weights<QT>(sb, j);
      const __m256i w_abs = QT == kQ6_K ? _mm256_abs_epi8(w) : w;
      const __m256i scale = kq_scale_lanes<QT>(scale_bytes, j);
      const int8_t* x = xq.q_row(m0) + (s * 8 + j) * kBlock;  // row m0; + r rows below
      for (int r = 0; r < MR; ++r) {
        __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * xq.blocks * kBlock));
        if constexpr (QT == kQ6_K) xv = _mm256_sign_epi8(xv, w);  // signed x signed, as Q8_0
        sum[r] = scaled_dot(sum[r], w_abs, xv, scale);
      }
    }
    const float d = half_to_float(sb + (QT == kQ6_K ? 208 : 0));
    for (int r = 0; r < MR; ++r) {
      const __m256 dx = _mm256_set1_ps(d * xq.d_row(m0 + r)[s * 8]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), dx, acc[r]);
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
