// Every GGUF block layout the CPU kernels read, unpacked per 32 weights (see quant_blocks.h).
//
// K-quant super-blocks of 256 weights (ggml's block_q4_K, block_q5_K, block_q6_K):
//   Q4_K: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 nibble bytes
//         sub-block j: w = d * sc_j * q - dmin * m_j
//   Q5_K: as Q4_K plus 32 bytes of high bits (bit j of byte l is weight l of sub-block j)
//   Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d
//         each 16 weights: w = d * sc * (q - 32)
// Nibbles of Q4_K/Q5_K: byte l of the 32-byte group g holds weight l of sub-block 2g in its low
// half and of sub-block 2g + 1 in its high half. Q6_K: each half of 128 weights reads 64 ql and
// 32 qh bytes; its sub-block k (0..3) takes ql[l + 32 * (k & 1)] >> (4 * (k >> 1)) and
// (qh[l] >> 2k) & 3 for weight l, with scales sc[2k] (l < 16) and sc[2k + 1].
#pragma once

#include <cstdint>

#include "freetoken/quant_blocks.h"

namespace freetoken {
namespace quant {

/*! \brief Sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block (ggml's get_scale_min_k4). */
inline void scale_min_k4(const uint8_t* scales, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = scales[j] & 63;
    *m = scales[j + 4] & 63;
  } else {
    *sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
    *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
  }
}

// Legacy 32-weight blocks: nibbles (+ a fifth bit) with d and an offset, or Q8_0's bytes.
inline void unpack_legacy(const uint8_t* blk, int64_t qtype, SubBlock* out) {
  const float d = half_at(blk);
  out->scale[0] = out->scale[1] = d;
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) out->q[i] = q[i];
    out->offset = 0.f;
    return;
  }
  const bool with_min = qtype == kQ4_1 || qtype == kQ5_1;
  const bool five = qtype == kQ5_0 || qtype == kQ5_1;
  const uint8_t* qs = blk + (with_min ? 4 : 2) + (five ? 4 : 0);
  uint32_t high = 0;
  if (five) std::memcpy(&high, blk + (with_min ? 4 : 2), 4);
  for (int i = 0; i < 16; ++i) {
    out->q[i] = static_cast<int16_t>((qs[i] & 0x0F) | (((high >> i) & 1) << 4));
    out->q[i + 16] = static_cast<int16_t>((qs[i] >> 4) | (((high >> (i + 16)) & 1) << 4));
  }
  out->offset = with_min ? half_at(blk + 2) : (five ? -16.f : -8.f) * d;
}

// Q4_K / Q5_K sub-block j (0..7) of super-block `sb`.
inline void unpack_k45(const uint8_t* sb, bool five, int j, SubBlock* out) {
  const float d = half_at(sb), dmin = half_at(sb + 2);
  int sc, m;
  scale_min_k4(sb + 4, j, &sc, &m);
  const uint8_t* qh = sb + 16;
  const uint8_t* qs = sb + (five ? 48 : 16) + 32 * (j / 2);
  const int shift = 4 * (j % 2);
  for (int l = 0; l < 32; ++l) {
    int q = (qs[l] >> shift) & 0x0F;
    if (five) q |= ((qh[l] >> j) & 1) << 4;
    out->q[l] = static_cast<int16_t>(q);
  }
  out->scale[0] = out->scale[1] = d * static_cast<float>(sc);
  out->offset = -dmin * static_cast<float>(m);
}

// Q6_K sub-block j (0..7) of super-block `sb`.
inline void unpack_q6k(const uint8_t* sb, int j, SubBlock* out) {
  const int half = j / 4, k = j % 4;
  const uint8_t* ql = sb + 64 * half + 32 * (k & 1);
  const uint8_t* qh = sb + 128 + 32 * half;
  const int8_t* sc = reinterpret_cast<const int8_t*>(sb + 192) + 8 * half + 2 * k;
  const float d = half_at(sb + 208);
  for (int l = 0; l < 32; ++l) {
    const int q = ((ql[l] >> (4 * (k >> 1))) & 0x0F) | (((qh[l] >> (2 * k)) & 3) << 4);
    out->q[l] = static_cast<int16_t>(q - 32);
  }
  out->scale[0] = d * static_cast<float>(sc[0]);
  out->scale[1] = d * static_cast<float>(sc[1]);
  out->offset = 0.f;
}

inline void unpack_block(const uint8_t* row, int64_t qtype, int64_t b, SubBlock* out) {
  if (!is_kquant(qtype)) {
    unpack_legacy(row + b * block_bytes(qtype), qtype, out);
    return;
  }
  const uint8_t* sb = row + (b / 8) * block_bytes(qtype);
  const int j = static_cast<int>(b % 8);
  if (qtype == kQ6_K) {
    unpack_q6k(sb, j, out);
  } else {
    unpack_k45(sb, qtype == kQ5_K, j, out);
  }
}

/*! \brief The 32 float weights of block `b` of a row. */
inline void dequantize_block(const uint8_t* row, int64_t qtype, int64_t b, float* out) {
  SubBlock sb;
  unpack_block(row, qtype, b, &sb);
  for (int i = 0; i < 32; ++i) out[i] = sb.scale[i / 16] * static_cast<float>(sb.q[i]) + sb.offset;
}

}  // namespace quant
}  // namespace freetoken
