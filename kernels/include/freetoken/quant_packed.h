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
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "freetoken/quant_blocks.h"

namespace freetoken {
namespace quant {

constexpr int64_t kPackRows = 16;

inline bool packable_type(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0;
}

inline bool has_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }
inline bool has_fifth_bits(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ5_1; }

/*! \brief Rewrite GGUF rows [16 * t0, 16 * t1) of src into the packed layout at dst. */
inline void pack_tiles(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t qtype,
                       int64_t t0, int64_t t1) {
  const int64_t bb = block_bytes(qtype), blocks = row_bytes / bb;
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

#define FT_QP_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define FT_QP_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"), always_inline)) inline

FT_QP_INLINE __m512i broadcast_word(const int8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// How far ahead decode asks for the weight stream (bytes): one core keeps more misses in flight
// than its hardware prefetcher does.
constexpr int64_t kAheadBytes = 2048;

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
    if (prefetch) {
      for (int64_t at = 0; at < kTileBlock; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAheadBytes + at), _MM_HINT_T0);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512 offset =
        kMin ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))
             : _mm512_mul_ps(dw, _mm512_set1_ps(QT == kQ4_0 ? -8.f : QT == kQ5_0 ? -16.f : -128.f));
    const uint8_t* fifth = p + kHeads;
    const uint8_t* q = fifth + kMasks;
    __m512i even[MR], odd[MR];
    for (int r = 0; r < MR; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    if constexpr (QT == kQ8_0) {
      for (int g = 0; g < 8; g += 2) {
        const __m512i w0 = _mm512_loadu_si512(q + 64 * g), w1 = _mm512_loadu_si512(q + 64 * (g + 1));
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

template <int64_t QT>
FT_QP_FN void rows_typed(const uint8_t* w, int64_t row_bytes, int64_t t0, int64_t t1,
                         const QuantizedRows& xq, float* out, int64_t ldo) {
  // Decode streams each tile once, prefetching ahead (into the next tile at the end, never
  // past the tensor: see last). Prefill keeps a tile (<= 16 rows x row_bytes) in L1 while the
  // activation rows pass over it four at a time.
  const int64_t tiles = ldo / kPackRows;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w + t * kPackRows * row_bytes;
    const int64_t n0 = t * kPackRows;
    if (xq.rows == 1) {
      tile_rows<QT, 1>(tile, xq, 0, out, ldo, n0, t + 1 < tiles);
      continue;
    }
    int64_t m0 = 0;
    for (; m0 + 4 <= xq.rows; m0 += 4) tile_rows<QT, 4>(tile, xq, m0, out, ldo, n0, false);
    switch (xq.rows - m0) {
      case 3: tile_rows<QT, 3>(tile, xq, m0, out, ldo, n0, false); break;
      case 2: tile_rows<QT, 2>(tile, xq, m0, out, ldo, n0, false); break;
      case 1: tile_rows<QT, 1>(tile, xq, m0, out, ldo, n0, false); break;
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
    default: break;
  }
}

#undef FT_QP_FN
#undef FT_QP_INLINE

}  // namespace packed
}  // namespace quant
}  // namespace freetoken
