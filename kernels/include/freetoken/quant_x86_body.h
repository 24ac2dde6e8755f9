// The x86 SIMD path of the quantized matmul, written once and compiled once per ISA.
//
// No include guard on purpose: quant_dispatch.h includes this file once per ISA, each time with
//   FT_QX_NS      the namespace to define (avx2, avx512)
//   FT_QX_TARGET  the GCC target string of every function here
//   FT_QX_VNNI    1 to use vpdpbusd / vpdpwssd and AVX-512BW byte masks on 256-bit vectors,
//                 0 for vpmaddubsw / vpmaddwd
// The two ISAs differ only where FT_QX_VNNI is tested (dot_u8_i8, scaled_dot, with_fifth_bits,
// kQ8Biased); everything else is shared, so testing one exercises the other's logic.
// NOTE: lambdas do not inherit target attributes, so none are used here.

#define FT_QX_FN __attribute__((target(FT_QX_TARGET)))
#define FT_QX_INLINE __attribute__((target(FT_QX_TARGET), always_inline)) inline

namespace FT_QX_NS {

// 16 nibble bytes -> 32 unsigned bytes: low nibbles are elements 0..15, high nibbles 16..31.
// The upper copy is shifted by 4 within 32-bit lanes; the mask drops bits from the next byte.
FT_QX_INLINE __m256i unpack_nibbles(const uint8_t* qs) {
  __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  both = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 32 bits -> 32 bytes, 0x10 where the bit is set (the fifth bit of Q5 weights).
FT_QX_INLINE __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i one_bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, one_bit), one_bit),
                          _mm256_set1_epi8(0x10));
}

// f16 -> float with F16C: a float multiply that rebuilds a subnormal half (Q6_K and Q4_K
// super-block scales often are) takes a microcode assist of ~100 cycles; cvtph does not.
FT_QX_INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Eight f16 values held in the low 16 bits of each 32-bit lane -> floats.
FT_QX_INLINE __m256 halves_to_float(__m256i h) {
  const __m256i low = _mm256_and_si256(h, _mm256_set1_epi32(0xffff));
  return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(low),
                                          _mm256_extracti128_si256(low, 1)));
}

// Products of unsigned `w` and signed `x` bytes summed in groups of four: 8 lanes, as floats.
FT_QX_INLINE __m256 dot_u8_i8(__m256i w, __m256i x) {
#if FT_QX_VNNI
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x));
#else
  __m256i pairs = _mm256_maddubs_epi16(w, x);  // |pair sum| <= 2*128*127: no saturation
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

FT_QX_INLINE float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

FT_QX_INLINE int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

FT_QX_INLINE __m256 abs_max(__m256 m, const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  return m;
}

FT_QX_INLINE float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One block of 32 to int8 with the scale amax / 127 (amax >= max |x| of the block).
FT_QX_INLINE void quantize_block(const float* x, float amax, int8_t* q, float* d, float* s) {
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  __m256i iq[4];
  for (int i = 0; i < 4; ++i) {
    iq[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), _mm256_set1_ps(inv)));
  }
  int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(iq[0], iq[1]), _mm256_add_epi32(iq[2], iq[3])));
  // packs interleave 128-bit lanes; the permute restores element order 0..31
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(iq[0], iq[1]), _mm256_packs_epi32(iq[2], iq[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

/*!
 * \brief Quantize activation rows [r0, r1) of x (row stride ldx) into xq, one scale per
 * `group` blocks (as quantize_group_scalar).
 */
FT_QX_FN void quantize_rows(const float* x, int64_t ldx, int64_t r0, int64_t r1, int64_t group,
                            const QuantizedRows& xq) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * ldx;
    for (int64_t g = 0; g < xq.blocks; g += group) {
      __m256 m = _mm256_setzero_ps();
      for (int64_t b = g; b < g + group; ++b) m = abs_max(m, row + b * kBlock);
      const float amax = lanes_max(m);
      for (int64_t b = g; b < g + group; ++b) {
        const int64_t at = r * xq.blocks + b;
        quantize_block(row + b * kBlock, amax, xq.q + at * kBlock, xq.d + at, xq.s + at);
      }
    }
  }
}

// With VNNI, Q8_0's signed weights are read as unsigned w + 128 (vpdpbusd sums four products
// in int32, so nothing saturates) and -128 * d meets the activation sums as Q4_0's -8 * d does:
// one xor a block instead of abs and sign. vpmaddubsw's int16 pair sums would saturate.
constexpr bool kQ8Biased = FT_QX_VNNI;

// Q5 weights: bit 4 of byte i set where bit i of the block's 32 high bits is.
FT_QX_INLINE __m256i with_fifth_bits(__m256i q, const uint8_t* bits) {
#if FT_QX_VNNI  // AVX-512BW: the 32 bits are a byte mask as they stand
  uint32_t mask;
  std::memcpy(&mask, bits, 4);
  return _mm256_mask_add_epi8(q, static_cast<__mmask32>(mask), q, _mm256_set1_epi8(0x10));
#else
  return _mm256_or_si256(q, fifth_bits(bits));
#endif
}

template <int64_t QT>
FT_QX_INLINE __m256i weight_bytes(const uint8_t* blk) {
  if constexpr (QT == kQ8_0) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    return kQ8Biased ? _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80))) : w;
  }
  if constexpr (QT == kQ5_0) return with_fifth_bits(unpack_nibbles(blk + 6), blk + 2);
  if constexpr (QT == kQ5_1) return with_fifth_bits(unpack_nibbles(blk + 8), blk + 4);
  return unpack_nibbles(blk + (QT == kQ4_1 ? 4 : 2));
}

// Integer dot product of one weight block with one activation block, as 8 float lanes.
template <int64_t QT>
FT_QX_INLINE __m256 block_dot(__m256i w, const int8_t* x_block) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x_block));
  // signed x signed (Q8_0 without VNNI) is computed as |w| x (x * sign of w)
  if constexpr (QT == kQ8_0 && !kQ8Biased) return dot_u8_i8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return dot_u8_i8(w, x);
}

FT_QX_INLINE int word_at(const uint8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

FT_QX_INLINE __m256i first_lanes(int count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The first 4 bytes (f16 scale, then Q4_1's f16 min) of `count` <= 8 blocks `stride` apart;
// lanes past `count` are 0. Built with inserts (a gather is several times slower on Zen 3, a
// stack array stalls store forwarding); reads past `count` repeat the last block, never beyond.
FT_QX_INLINE __m256i block_heads(const uint8_t* g, int stride, int count) {
  const uint8_t* at[8];
  for (int i = 0; i < 8; ++i) at[i] = g + std::min(i, count - 1) * stride;
  __m128i lo = _mm_cvtsi32_si128(word_at(at[0]));
  lo = _mm_insert_epi32(lo, word_at(at[1]), 1);
  lo = _mm_insert_epi32(lo, word_at(at[2]), 2);
  lo = _mm_insert_epi32(lo, word_at(at[3]), 3);
  __m128i hi = _mm_cvtsi32_si128(word_at(at[4]));
  hi = _mm_insert_epi32(hi, word_at(at[5]), 1);
  hi = _mm_insert_epi32(hi, word_at(at[6]), 2);
  hi = _mm_insert_epi32(hi, word_at(at[7]), 3);
  __m256i heads = _mm256_set_m128i(hi, lo);
  return count == 8 ? heads : _mm256_and_si256(heads, first_lanes(count));
}

FT_QX_INLINE __m256 load_first(const float* p, int count) {
  if (count == 8) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, first_lanes(count));  // never touches memory past the row
}

/*!
 * \brief Blocks [b, b + count) (count <= 8) of NR weight rows against MR activation rows.
 * The f16 scales of the 8 blocks are converted together and multiplied by the activation
 * scales up front, so each block costs only unpack, integer dot, convert and one FMA per pair.
 * The offset terms (min, or -8, -16 or (biased Q8_0) -128 times the scale, times the activation
 * block sums) land in acc too: every lane is summed at the end anyway.
 */
template <int64_t QT, int NR, int MR, int kCount>
FT_QX_INLINE void accumulate_group(const uint8_t* const* w, int64_t b, int count,
                                   const QuantizedRows& xq, int64_t m0, __m256 (&acc)[NR][MR]) {
  constexpr int kBytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : QT == kQ5_0 ? 22 : QT == kQ5_1 ? 24 : 34;
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1;
  constexpr bool kOffset = QT != kQ8_0 || kQ8Biased;
  const int n_blocks = kCount == 8 ? 8 : count;
  alignas(32) float scale[NR][MR][8];
  __m256 dw[NR], offset[NR];
  for (int n = 0; n < NR; ++n) {
    __m256i heads = block_heads(w[n] + b * kBytes, kBytes, n_blocks);
    dw[n] = halves_to_float(heads);
    offset[n] = kMin ? halves_to_float(_mm256_srli_epi32(heads, 16))
                     : _mm256_mul_ps(dw[n], _mm256_set1_ps(QT == kQ5_0 ? -16.f : QT == kQ8_0 ? -128.f : -8.f));
  }
  for (int r = 0; r < MR; ++r) {
    __m256 dx = load_first(xq.d_row(m0 + r) + b, n_blocks);
    __m256 sx = kOffset ? load_first(xq.s_row(m0 + r) + b, n_blocks) : dx;
    for (int n = 0; n < NR; ++n) {
      _mm256_store_ps(scale[n][r], _mm256_mul_ps(dw[n], dx));
      if constexpr (kOffset) acc[n][r] = _mm256_fmadd_ps(offset[n], sx, acc[n][r]);
    }
  }
  for (int k = 0; k < n_blocks; ++k) {
    const int8_t* x = xq.q + (m0 * xq.blocks + b + k) * kBlock;  // row m0; + r rows below
    for (int n = 0; n < NR; ++n) {
      __m256i wb = weight_bytes<QT>(w[n] + (b + k) * kBytes);
      for (int r = 0; r < MR; ++r) {
        __m256 dot = block_dot<QT>(wb, x + r * xq.blocks * kBlock);
        acc[n][r] = _mm256_fmadd_ps(dot, _mm256_broadcast_ss(&scale[n][r][k]), acc[n][r]);
      }
    }
  }
}

// Sums of four vectors' lanes: [sum a, sum b, sum c, sum d].
FT_QX_INLINE __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/*! \brief out[(m0 + r) * ldo + n0 + n] for NR weight rows from n0 and MR activation rows. */
template <int64_t QT, int NR, int MR>
FT_QX_INLINE void dot_tile(const uint8_t* w, int64_t row_bytes, int64_t n0,
                           const QuantizedRows& xq, int64_t m0, float* out, int64_t ldo) {
  const uint8_t* rows[NR];
  __m256 acc[NR][MR];
  for (int n = 0; n < NR; ++n) {
    rows[n] = w + (n0 + n) * row_bytes;
    for (int r = 0; r < MR; ++r) acc[n][r] = _mm256_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 8 <= xq.blocks; b += 8) accumulate_group<QT, NR, MR, 8>(rows, b, 8, xq, m0, acc);
  if (b < xq.blocks) accumulate_group<QT, NR, MR, 0>(rows, b, static_cast<int>(xq.blocks - b), xq, m0, acc);
  for (int r = 0; r < MR; ++r) {
    float* o = out + (m0 + r) * ldo + n0;
    if constexpr (NR == 4) {
      _mm_storeu_ps(o, hsum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
    } else {
      for (int n = 0; n < NR; ++n) o[n] = hsum(acc[n][r]);
    }
  }
}

constexpr int64_t kPrefetchBytes = 2048;

template <int64_t QT, int MR>
FT_QX_FN void matmul_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                          const QuantizedRows& xq, int64_t m0, float* out, int64_t ldo) {
  int64_t n = n0;
  if constexpr (MR == 1) {  // one activation row: four weight rows share each x block
    // Decode streams the weights once: ask for the lines ~kPrefetchBytes ahead while this tile
    // is computed, so one core keeps more misses in flight than its hardware prefetcher does
    // (measured: the Q8_0 head from DRAM on one core, 5.5 -> 3.0 ms).
    // It runs on past n1 into the next chunk (claimed next, by this or the other core), so a
    // chunk does not start on a cold stream; out is [M, N], so ldo bounds it at the last row.
    const int64_t tile_bytes = 4 * row_bytes;
    const int64_t ahead_rows = 4 * ((kPrefetchBytes + tile_bytes - 1) / tile_bytes);
    for (; n + 4 <= n1; n += 4) {
      if (n + ahead_rows + 4 <= ldo) {
        const char* ahead = reinterpret_cast<const char*>(w + (n + ahead_rows) * row_bytes);
        for (int64_t b = 0; b < tile_bytes; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
      dot_tile<QT, 4, 1>(w, row_bytes, n, xq, m0, out, ldo);
    }
  }
  for (; n < n1; ++n) dot_tile<QT, 1, MR>(w, row_bytes, n, xq, m0, out, ldo);
}

template <int64_t QT>
FT_QX_FN void matmul_rows_typed(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1,
                                const QuantizedRows& xq, float* out, int64_t ldo) {
  // Tiles of four activation rows reuse each unpacked weight block four times; the caller keeps
  // [n0, n1) small enough for those weight rows to stay in L1 across the tiles.
  int64_t m0 = 0;
  for (; m0 + 4 <= xq.rows; m0 += 4) matmul_tile<QT, 4>(w, row_bytes, n0, n1, xq, m0, out, ldo);
  switch (xq.rows - m0) {
    case 3: matmul_tile<QT, 3>(w, row_bytes, n0, n1, xq, m0, out, ldo); break;
    case 2: matmul_tile<QT, 2>(w, row_bytes, n0, n1, xq, m0, out, ldo); break;
    case 1: matmul_tile<QT, 1>(w, row_bytes, n0, n1, xq, m0, out, ldo); break;
    default: break;
  }
}

#include "freetoken/quant_x86_kquant.h"

/*! \brief out[m, n] for every activation row m and weight rows n in [n0, n1). */
FT_QX_FN void matmul_rows(const uint8_t* w, int64_t row_bytes, int64_t qtype, int64_t n0,
                          int64_t n1, const QuantizedRows& xq, float* out, int64_t ldo) {
  switch (qtype) {
    case kQ4_0: matmul_rows_typed<kQ4_0>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ4_1: matmul_rows_typed<kQ4_1>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ5_0: matmul_rows_typed<kQ5_0>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ5_1: matmul_rows_typed<kQ5_1>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ8_0: matmul_rows_typed<kQ8_0>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ4_K: kquant_rows<kQ4_K>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ5_K: kquant_rows<kQ5_K>(w, row_bytes, n0, n1, xq, out, ldo); break;
    case kQ6_K: kquant_rows<kQ6_K>(w, row_bytes, n0, n1, xq, out, ldo); break;
    default: break;
  }
}

}  // namespace FT_QX_NS

#undef FT_QX_FN
#undef FT_QX_INLINE
