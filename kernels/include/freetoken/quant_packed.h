// GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights repacked for AVX-512 VNNI: 16 weight rows side
// by side.
//
// The GGUF layout keeps each row's blocks apart, so a product reads one row at a time, sums the
// lanes of every row and builds every block's scale on its own (~9 instructions per 32 weights
// of one row). Packed, one 512-bit vpdpbusd serves 4 weights of 16 rows, each row's sum stays in
// its own lane, and one f16 -> f32 convert yields the 16 rows' scales of a block.
//
// The packed tensor has the GGUF tensor's shape and byte count. Tile t (rows 16t..16t+15),
// block b (weights 32b..32b+31) sits at t * 16 * row_bytes + b * 16 * block_bytes:
//   16 f16 d                       (row order)
//   16 f16 m                       (Q4_1, Q5_1)
//   8 x 64-bit masks               (Q5_0, Q5_1) the fifth bits, see below
//   W words of 4 bytes x 16 rows   word g of row n at (g * 16 + n) * 4; W = 4 (Q4/Q5) or 8 (Q8_0)
// The words are the block's quant bytes as stored, so a Q4/Q5 word g holds elements 4g..4g+3 in
// its low nibbles and 16+4g..16+4g+3 in its high ones. Q5's fifth bits are regrouped to match:
// mask j (j < 4: the low nibbles of word j; j >= 4: the high nibbles of word j - 4) has bit
// 4n + i set where byte i of row n's word needs 16 added, so one masked byte add restores them.
// Q8_0 bytes are stored plus 128 (as unsigned) so vpdpbusd takes them as they are; the
// -128 * d offset meets the activation sums.
//
// The K-quants pack per super-block of 256 weights (tile t, super-block s at
// t * 16 * row_bytes + s * 16 * block_bytes), in the same bytes:
//   Q4_K: 16 f16 d, 16 f16 dmin, then the 8 (6-bit scale, 6-bit min) pairs of each row as three
//         words x 16 rows: the scales' low nibbles (nibble j: sub-block j), the mins' low
//         nibbles, and the high bits (bits 2j..2j+1: scale j, bits 16+2j..: min j); then the
//         128 nibble bytes as 32 words x 16 rows (word g of row n at (g * 16 + n) * 4).
//   Q6_K: 16 f16 d, the 16 int8 scales as [scale k][row n], then ql as 32 words x 16 rows and
//         qh as 16 words x 16 rows. Its q - 32 offset needs each 16 activations' sum (sum16).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "freetoken/quant_blocks.h"

namespace freetoken {
namespace quant {

constexpr int64_t kPackRows = 16;
// Up to this many activation rows (a decode step, or a speculative verify step of K + 1
// tokens) a product streams each weight tile from memory once, prefetching ahead, in chunks of
// decode's size; more rows (prefill) reuse a tile from L1 across many activation rows.
constexpr int64_t kStreamRows = 8;

inline bool packable_type(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0 ||
         qtype == kQ4_K || qtype == kQ6_K;
}

// Packed Q6_K reads QuantizedRows::sum16, which the caller fills (fill_sum16).
inline bool needs_sum16(int64_t qtype) { return qtype == kQ6_K; }

/*! \brief xq's sum16 for rows [r0, r1) into `sums` ([rows][2 * blocks]). */
inline void fill_sum16(const QuantizedRows& xq, int64_t r0, int64_t r1, int32_t* sums) {
  for (int64_t r = r0; r < r1; ++r) {
    const int8_t* x = xq.q_row(r);
    for (int64_t g = 0; g < 2 * xq.blocks; ++g) {
      int32_t sum = 0;
      for (int i = 0; i < 16; ++i) sum += x[16 * g + i];
      sums[r * 2 * xq.blocks + g] = 32 * sum;
    }
  }
}

inline bool has_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }
inline bool has_fifth_bits(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ5_1; }

// Q4_K / Q6_K super-block s of rows 16t..16t+15 into `out` (see the layout above).
inline void pack_ksuper(const uint8_t* src, uint8_t* out, int64_t row_bytes, int64_t qtype,
                        int64_t t, int64_t s) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t n = 0; n < kPackRows; ++n) {
    const uint8_t* blk = src + (t * kPackRows + n) * row_bytes + s * bb;
    if (qtype == kQ4_K) {
      std::memcpy(out + 2 * n, blk, 2);
      std::memcpy(out + 32 + 2 * n, blk + 2, 2);
      uint32_t scale_low = 0, min_low = 0, high = 0;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        scale_min_k4(blk + 4, j, &sc, &m);
        scale_low |= static_cast<uint32_t>(sc & 0xF) << (4 * j);
        min_low |= static_cast<uint32_t>(m & 0xF) << (4 * j);
        high |= static_cast<uint32_t>(sc >> 4) << (2 * j);
        high |= static_cast<uint32_t>(m >> 4) << (16 + 2 * j);
      }
      std::memcpy(out + 64 + 4 * n, &scale_low, 4);
      std::memcpy(out + 128 + 4 * n, &min_low, 4);
      std::memcpy(out + 192 + 4 * n, &high, 4);
      for (int g = 0; g < 32; ++g) {
        std::memcpy(out + 256 + (g * kPackRows + n) * 4, blk + 16 + 4 * g, 4);
      }
    } else {  // Q6_K: ql[128], qh[64], scales[16], d
      std::memcpy(out + 2 * n, blk + 208, 2);
      for (int k = 0; k < 16; ++k) out[32 + k * kPackRows + n] = blk[192 + k];
      for (int g = 0; g < 32; ++g) std::memcpy(out + 288 + (g * kPackRows + n) * 4, blk + 4 * g, 4);
      for (int g = 0; g < 16; ++g) {
        std::memcpy(out + 288 + 2048 + (g * kPackRows + n) * 4, blk + 128 + 4 * g, 4);
      }
    }
  }
}

/*! \brief Rewrite GGUF rows [16 * t0, 16 * t1) of src into the packed layout at dst. */
inline void pack_tiles(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t qtype,
                       int64_t t0, int64_t t1) {
  const int64_t bb = block_bytes(qtype), blocks = row_bytes / bb;
  if (is_kquant(qtype)) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t s = 0; s < blocks; ++s) {
        uint8_t* out = dst + t * kPackRows * row_bytes + s * kPackRows * bb;
        pack_ksuper(src, out, row_bytes, qtype, t, s);
      }
    }
    return;
  }
  const int64_t heads = has_min(qtype) ? 2 : 1, words = qtype == kQ8_0 ? 8 : 4;
  const int64_t masks = has_fifth_bits(qtype) ? 64 : 0;
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* out = dst + t * kPackRows * row_bytes + b * kPackRows * bb;
      uint64_t fifth[8] = {};
      for (int64_t n = 0; n < kPackRows; ++n) {
        const uint8_t* blk = src + (t * kPackRows + n) * row_bytes + b * bb;
        for (int64_t h = 0; h < heads; ++h) std::memcpy(out + h * 32 + 2 * n, blk + 2 * h, 2);
        uint32_t high = 0;
        if (masks) std::memcpy(&high, blk + 2 * heads, 4);
        for (int64_t j = 0; j < 8 && masks; ++j) {
          const int64_t first = j < 4 ? 4 * j : 16 + 4 * (j - 4);  // the element of byte 0
          fifth[j] |= static_cast<uint64_t>((high >> first) & 0xF) << (4 * n);
        }
        const uint8_t* qs = blk + 2 * heads + (masks ? 4 : 0);
        for (int64_t g = 0; g < words; ++g) {
          uint32_t word;
          std::memcpy(&word, qs + 4 * g, 4);
          if (qtype == kQ8_0) word ^= 0x80808080u;
          std::memcpy(out + heads * 32 + masks + (g * kPackRows + n) * 4, &word, 4);
        }
      }
      if (masks) std::memcpy(out + heads * 32, fifth, sizeof(fifth));
    }
  }
}

namespace packed {

#define FT_QP_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define FT_QP_FN __attribute__((target(FT_QP_TARGET)))
#define FT_QP_INLINE __attribute__((target(FT_QP_TARGET), always_inline)) inline

// 16 f16 values (one per packed row) as floats.
FT_QP_INLINE __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

FT_QP_INLINE __m512i broadcast_word(const int8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// How far ahead decode asks for the weight stream (bytes): one core keeps more misses in flight
// than its hardware prefetcher does.
constexpr int64_t kAheadBytes = 2048;

// Asks for `bytes` of the weight stream kAheadBytes past p (a prefetch never faults).
FT_QP_INLINE void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t at = 0; at < bytes; at += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kAheadBytes + at), _MM_HINT_T0);
  }
}

/*!
 * \brief out[(m0 + r) * ldo + n0 .. + 16] for the 16 packed rows of `tile` and activation rows
 * m0..m0+MR-1. Each block: integer sums in two chains (so consecutive vpdpbusd do not wait on
 * each other), then one FMA with d_w * d_x and one with the offset times the activation sums.
 */
template <int64_t QT, int MR>
FT_QP_INLINE void tile_rows(const uint8_t* tile, const QuantizedRows& xq, int64_t m0, float* out,
                            int64_t ldo, int64_t n0, bool prefetch) {
  constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1, kFifth = QT == kQ5_0 || QT == kQ5_1;
  constexpr int64_t kTileBlock =
      kPackRows * (QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : QT == kQ5_0 ? 22 : QT == kQ5_1 ? 24 : 34);
  constexpr int64_t kHeads = kMin ? 64 : 32, kMasks = kFifth ? 64 : 0;
  const __m512i low4 = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(0x10);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* p = tile + b * kTileBlock;
    if (prefetch) prefetch_ahead(p, kTileBlock);
    const __m512 dw = halves(p);
    const __m512 offset =
        kMin ? halves(p + 32)
             : _mm512_mul_ps(dw, _mm512_set1_ps(QT == kQ4_0 ? -8.f : QT == kQ5_0 ? -16.f : -128.f));
    const uint8_t* fifth = p + kHeads;
    const uint8_t* q = fifth + kMasks;
    __m512i even[MR], odd[MR];
    for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    if constexpr (QT == kQ8_0) {
      for (int g = 0; g < 8; g += 2) {
        const __m512i w0 = _mm512_loadu_si512(q + 64 * g);
        const __m512i w1 = _mm512_loadu_si512(q + 64 * (g + 1));
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xq.q_row(m0 + r) + b * kBlock;
          even[r] = _mm512_dpbusd_epi32(even[r], w0, broadcast_word(x + 4 * g));
          odd[r] = _mm512_dpbusd_epi32(odd[r], w1, broadcast_word(x + 4 * g + 4));
        }
      }
    } else {
      for (int g = 0; g < 4; ++g) {
        const __m512i w = _mm512_loadu_si512(q + 64 * g);
        __m512i lo = _mm512_and_si512(w, low4);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        if constexpr (kFifth) {
          uint64_t lo_bits, hi_bits;
          std::memcpy(&lo_bits, fifth + 8 * g, 8);
          std::memcpy(&hi_bits, fifth + 32 + 8 * g, 8);
          lo = _mm512_mask_add_epi8(lo, lo_bits, lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, hi_bits, hi, sixteen);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xq.q_row(m0 + r) + b * kBlock;
          even[r] = _mm512_dpbusd_epi32(even[r], lo, broadcast_word(x + 4 * g));
          odd[r] = _mm512_dpbusd_epi32(odd[r], hi, broadcast_word(x + 16 + 4 * g));
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
      const __m512 dx = _mm512_set1_ps(xq.d_row(m0 + r)[b]);
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, dx), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xq.s_row(m0 + r)[b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + (m0 + r) * ldo + n0, acc[r]);
}

FT_QP_INLINE __m512i shift_right32(__m512i v, int bits) {
  return _mm512_srl_epi32(v, _mm_cvtsi32_si128(bits));
}

// Lane n: the 6-bit value whose low nibble is nibble j of `low` and whose top two bits are bits
// at..at+1 of `high` (a Q4_K scale or min of sub-block j, for 16 rows).
FT_QP_INLINE __m512i six_bits(__m512i low, __m512i high, int j, int at) {
  const __m512i low4 = _mm512_set1_epi32(0xF), two = _mm512_set1_epi32(3);
  return _mm512_or_si512(_mm512_and_si512(shift_right32(low, 4 * j), low4),
                         _mm512_slli_epi32(_mm512_and_si512(shift_right32(high, at), two), 4));
}

/*!
 * \brief As tile_rows, for Q4_K: per sub-block pair, integer sums for 16 rows, times each row's
 * 6-bit scale (vpmulld), summed over the super-block in int32; one FMA by d * dx, and the mins
 * against the activation block sums.
 */
template <int MR>
FT_QP_INLINE void q4k_tile_rows(const uint8_t* tile, const QuantizedRows& xq, int64_t m0,
                                float* out, int64_t ldo, int64_t n0, bool prefetch) {
  constexpr int64_t kTileSuper = kPackRows * 144;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < xq.blocks / 8; ++s) {
    const uint8_t* p = tile + s * kTileSuper;
    if (prefetch) prefetch_ahead(p, kTileSuper);
    const __m512 d = halves(p), dmin = halves(p + 32);
    const __m512i scale_low = _mm512_loadu_si512(p + 64), min_low = _mm512_loadu_si512(p + 128);
    const __m512i high = _mm512_loadu_si512(p + 192);
    const uint8_t* q = p + 256;
    __m512i total[MR];
    __m512 mins[MR];
    for (int r = 0; r < MR; ++r) {
      total[r] = _mm512_setzero_si512();
      mins[r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < 4; ++c) {  // nibble chunk c: sub-blocks 2c (low) and 2c + 1 (high)
      __m512i lo[MR], hi[MR];
      for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        const __m512i w = _mm512_loadu_si512(q + 64 * (8 * c + g));
        const __m512i wl = _mm512_and_si512(w, low4);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xq.q_row(m0 + r) + s * kSuper + 64 * c + 4 * g;
          lo[r] = _mm512_dpbusd_epi32(lo[r], wl, broadcast_word(x));
          hi[r] = _mm512_dpbusd_epi32(hi[r], wh, broadcast_word(x + 32));
        }
      }
      const __m512i sc_lo = six_bits(scale_low, high, 2 * c, 4 * c);
      const __m512i sc_hi = six_bits(scale_low, high, 2 * c + 1, 4 * c + 2);
      const __m512 m_lo = _mm512_cvtepi32_ps(six_bits(min_low, high, 2 * c, 16 + 4 * c));
      const __m512 m_hi = _mm512_cvtepi32_ps(six_bits(min_low, high, 2 * c + 1, 18 + 4 * c));
      for (int r = 0; r < MR; ++r) {
        total[r] = _mm512_add_epi32(total[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sc_lo),
                                                               _mm512_mullo_epi32(hi[r], sc_hi)));
        const float* sx = xq.s_row(m0 + r) + s * 8 + 2 * c;
        mins[r] = _mm512_fmadd_ps(m_lo, _mm512_set1_ps(sx[0]), mins[r]);
        mins[r] = _mm512_fmadd_ps(m_hi, _mm512_set1_ps(sx[1]), mins[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xq.d_row(m0 + r)[s * 8]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), acc[r]);
      acc[r] = _mm512_fnmadd_ps(dmin, mins[r], acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + (m0 + r) * ldo + n0, acc[r]);
}

/*!
 * \brief As tile_rows, for Q6_K: the 6-bit q (0..63) of 16 rows from a ql and a qh word, integer
 * sums per 16 weights, (sum - 32 * activation sum) times each row's int8 scale (vpmulld), summed
 * over the super-block in int32, then one FMA by d * dx.
 */
template <int MR>
FT_QP_INLINE void q6k_tile_rows(const uint8_t* tile, const QuantizedRows& xq, int64_t m0,
                                float* out, int64_t ldo, int64_t n0, bool prefetch) {
  constexpr int64_t kTileSuper = kPackRows * 210;
  const __m512i low4 = _mm512_set1_epi8(0x0F), b01 = _mm512_set1_epi8(0x03);
  const __m512i b23 = _mm512_set1_epi8(0x0C), b45 = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t s = 0; s < xq.blocks / 8; ++s) {
    const uint8_t* p = tile + s * kTileSuper;
    if (prefetch) prefetch_ahead(p, kTileSuper);
    const __m512 d = halves(p);
    const uint8_t* scales = p + 32;
    const uint8_t* ql = p + 288;
    const uint8_t* qh = ql + 2048;
    __m512i total[MR];
    for (int r = 0; r < MR; ++r) total[r] = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {       // halves of 128 weights
      for (int part = 0; part < 2; ++part) {  // words u of part 0 start groups 2t, of 1 2t + 1
        __m512i sum[4][MR];
        for (int t = 0; t < 4; ++t) {
          for (int r = 0; r < MR; ++r) sum[t][r] = _mm512_setzero_si512();
        }
        for (int u = 4 * part; u < 4 * part + 4; ++u) {
          const __m512i l1 = _mm512_loadu_si512(ql + 64 * (16 * h + u));
          const __m512i l2 = _mm512_loadu_si512(ql + 64 * (16 * h + 8 + u));
          const __m512i hq = _mm512_loadu_si512(qh + 64 * (8 * h + u));
          // weights 4u.. of the half's four 32-weight runs: low bits | high bits << 4
          const __m512i e[4] = {
              _mm512_or_si512(_mm512_and_si512(l1, low4),
                              _mm512_slli_epi16(_mm512_and_si512(hq, b01), 4)),
              _mm512_or_si512(_mm512_and_si512(l2, low4),
                              _mm512_slli_epi16(_mm512_and_si512(hq, b23), 2)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), low4),
                              _mm512_and_si512(hq, b45)),
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l2, 4), low4),
                              _mm512_and_si512(_mm512_srli_epi16(hq, 2), b45))};
          for (int r = 0; r < MR; ++r) {
            const int8_t* x = xq.q_row(m0 + r) + s * kSuper + 128 * h + 4 * u;
            for (int t = 0; t < 4; ++t) {
              sum[t][r] = _mm512_dpbusd_epi32(sum[t][r], e[t], broadcast_word(x + 32 * t));
            }
          }
        }
        for (int t = 0; t < 4; ++t) {
          const int k = 8 * h + 2 * t + part;  // this group of 16 weights
          const __m128i sc_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16 * k));
          const __m512i sc = _mm512_cvtepi8_epi32(sc_bytes);
          for (int r = 0; r < MR; ++r) {
            const int32_t* sums = xq.sum16 + (m0 + r) * 2 * xq.blocks + 16 * s;
            const __m512i centred = _mm512_sub_epi32(sum[t][r], _mm512_set1_epi32(sums[k]));
            total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(centred, sc));
          }
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xq.d_row(m0 + r)[s * 8]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, dx), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + (m0 + r) * ldo + n0, acc[r]);
}

// The tile kernel of a type: tile_rows, q4k_tile_rows or q6k_tile_rows.
template <int64_t QT, int MR>
FT_QP_INLINE void any_tile_rows(const uint8_t* tile, const QuantizedRows& xq, int64_t m0,
                                float* out, int64_t ldo, int64_t n0, bool prefetch) {
  if constexpr (QT == kQ4_K) {
    q4k_tile_rows<MR>(tile, xq, m0, out, ldo, n0, prefetch);
  } else if constexpr (QT == kQ6_K) {
    q6k_tile_rows<MR>(tile, xq, m0, out, ldo, n0, prefetch);
  } else {
    tile_rows<QT, MR>(tile, xq, m0, out, ldo, n0, prefetch);
  }
}

template <int64_t QT>
FT_QP_FN void rows_typed(const uint8_t* w, int64_t row_bytes, int64_t t0, int64_t t1,
                         const QuantizedRows& xq, float* out, int64_t ldo) {
  // Decode and verify steps (<= kStreamRows rows) stream each tile once, the tile's first pass
  // prefetching ahead (into the next tile at the end, never past the tensor); its other passes
  // find it in L1. Prefill keeps a tile (<= 16 rows x row_bytes) in L1 while the activation
  // rows pass over it four at a time.
  const int64_t tiles = ldo / kPackRows;
  const bool stream = xq.rows <= kStreamRows;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * kPackRows * row_bytes;
    const int64_t n0 = t * kPackRows;
    bool ahead = stream && t + 1 < tiles;
    if (xq.rows == 1) {
      any_tile_rows<QT, 1>(tile, xq, 0, out, ldo, n0, ahead);
      continue;
    }
    int64_t m0 = 0;
    if constexpr (QT == kQ6_K) {  // 4 groups x MR sums in registers: two rows at a time
      for (; m0 + 2 <= xq.rows; m0 += 2, ahead = false)
        any_tile_rows<QT, 2>(tile, xq, m0, out, ldo, n0, ahead);
    } else {
      for (; m0 + 4 <= xq.rows; m0 += 4, ahead = false)
        any_tile_rows<QT, 4>(tile, xq, m0, out, ldo, n0, ahead);
    }
    switch (xq.rows - m0) {
      case 3: any_tile_rows<QT, 3>(tile, xq, m0, out, ldo, n0, ahead); break;
      case 2: any_tile_rows<QT, 2>(tile, xq, m0, out, ldo, n0, ahead); break;
      case 1: any_tile_rows<QT, 1>(tile, xq, m0, out, ldo, n0, ahead); break;
      default: break;
    }
  }
}

/*!
 * \brief out[m * ldo + n] for every activation row m and packed tiles [t0, t1) (rows 16 t0 ..
 * 16 t1); ldo is the weight's row count (a multiple of 16).
 */
FT_QP_FN inline void matmul_tiles(const uint8_t* w, int64_t row_bytes, int64_t qtype, int64_t t0,
                                  int64_t t1, const QuantizedRows& xq, float* out, int64_t ldo) {
  switch (qtype) {
    case kQ4_0: rows_typed<kQ4_0>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ4_1: rows_typed<kQ4_1>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ5_0: rows_typed<kQ5_0>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ5_1: rows_typed<kQ5_1>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ8_0: rows_typed<kQ8_0>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ4_K: rows_typed<kQ4_K>(w, row_bytes, t0, t1, xq, out, ldo); break;
    case kQ6_K: rows_typed<kQ6_K>(w, row_bytes, t0, t1, xq, out, ldo); break;
    default: break;
  }
}

#undef FT_QP_FN
#undef FT_QP_INLINE
#undef FT_QP_TARGET

}  // namespace packed
}  // namespace quant
}  // namespace freetoken
