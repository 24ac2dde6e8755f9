// GGUF block formats read by the quantized CPU kernels, and the portable (scalar) path.
//
// The legacy formats hold 32 weights per block:
//   Q4_0: f16 d, 16 bytes of nibbles                  -> w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles           -> w = d * q + m
//   Q5_0: f16 d, 32 high bits, 16 bytes of nibbles    -> w = d * (q - 16)
//   Q5_1: f16 d, f16 m, 32 high bits, 16 nibble bytes -> w = d * q + m
//   Q8_0: f16 d, 32 int8                               -> w = d * q
// A nibble byte j holds element j in its low half and element j + 16 in its high half.
// The K-quants (quant_kblocks.h) hold 256 weights per super-block in 32-weight sub-blocks with
// their own scales, so everything below works per 32 weights for every format.
//
// Activations are quantized once per call to int8 per 32-block (scale dx, and sx = dx * sum q),
// so a block's dot product is integer: dw * dx * sum(qw * qx) + offset * sx, where the offset is
// m for Q4_1/Q5_1, -8 * dw for Q4_0, -16 * dw for Q5_0 and 0 for Q8_0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace quant {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8;
constexpr int64_t kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kBlock = 32;
constexpr int64_t kSuper = 256;  // weights per K-quant super-block

inline bool is_kquant(int64_t qtype) { return qtype >= kQ4_K && qtype <= kQ6_K; }

/*! \brief Bytes of one block (a super-block of 256 weights for K-quants); 0: unsupported. */
inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

/*! \brief Weights per block: 32, or 256 for the K-quants. */
inline int64_t block_weights(int64_t qtype) { return is_kquant(qtype) ? kSuper : kBlock; }

/*! \brief Bytes of one row of k weights (k a multiple of block_weights). */
inline int64_t row_bytes_of(int64_t qtype, int64_t k) {
  return k / block_weights(qtype) * block_bytes(qtype);
}

constexpr const char* kSupportedTypes =
    "Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13) or Q6_K (14)";

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

/*!
 * \brief Activation rows as int8 in 32-blocks; `blocks` blocks per row. Each block has its own
 * scale, or shares it with its super-block (see activation_group): d holds it per block either way.
 */
struct QuantizedRows {
  int64_t rows = 0, blocks = 0;
  int8_t* q = nullptr;   // [rows][blocks * 32]
  float* d = nullptr;    // [rows][blocks] scale
  float* s = nullptr;    // [rows][blocks] scale * sum of the block's int8 values
  // [rows][2 * blocks]: 32 * the sum of each 16 int8 values (quant_packed.h's Q6_K only)
  const int32_t* sum16 = nullptr;

  const int8_t* q_row(int64_t r) const { return q + r * blocks * kBlock; }
  const float* d_row(int64_t r) const { return d + r * blocks; }
  const float* s_row(int64_t r) const { return s + r * blocks; }
};

/*!
 * \brief 32-weight block `b` of a row as integers: w[i] = scale[i / 16] * q[i] + offset.
 * The one description of every format's layout, shared by dequantize_rows and the scalar path.
 */
struct SubBlock {
  int16_t q[32];
  float scale[2];
  float offset;
};

inline void unpack_block(const uint8_t* row, int64_t qtype, int64_t b, SubBlock* out);

// ------------------------------------------------------------------ scalar path

/*!
 * \brief Activation blocks that share one int8 scale: a whole super-block of 8 for the K-quants
 * (their kernels then sum a super-block's integer dots before one float multiply), else 1.
 */
inline int64_t activation_group(int64_t qtype) { return is_kquant(qtype) ? kSuper / kBlock : 1; }

// Blocks [b, b + group) of x to int8 with the scale max |x| / 127 over all of them; every
// block still records that scale in d[b] and scale * (its int sum) in s[b].
inline void quantize_group_scalar(const float* x, int64_t b, int64_t group, int8_t* q, float* d,
                                  float* s) {
  float amax = 0.f;
  for (int64_t i = b * kBlock; i < (b + group) * kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t k = b; k < b + group; ++k) {
    int sum = 0;
    for (int64_t i = k * kBlock; i < (k + 1) * kBlock; ++i) {
      int v = static_cast<int>(std::lrintf(x[i] * inv));  // nearest-even, like cvtps2dq
      q[i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[k] = scale;
    s[k] = scale * static_cast<float>(sum);
  }
}

/*! \brief One row of `blocks` blocks (a multiple of `group`) to int8, one scale per group. */
inline void quantize_row_scalar(const float* x, int64_t blocks, int64_t group, int8_t* q,
                                float* d, float* s) {
  for (int64_t b = 0; b < blocks; b += group) quantize_group_scalar(x, b, group, q, d, s);
}

inline float dot_row_scalar(const uint8_t* w, int64_t qtype, const QuantizedRows& xq,
                            int64_t r) {
  const int8_t* xrow = xq.q_row(r);
  float acc = 0.f, offset_acc = 0.f;
  SubBlock sb;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    unpack_block(w, qtype, b, &sb);
    const int8_t* x = xrow + b * kBlock;
    int32_t lo = 0, hi = 0;
    for (int i = 0; i < 16; ++i) lo += sb.q[i] * x[i];
    for (int i = 16; i < 32; ++i) hi += sb.q[i] * x[i];
    acc += xq.d_row(r)[b] * (sb.scale[0] * static_cast<float>(lo) + sb.scale[1] * static_cast<float>(hi));
    offset_acc += sb.offset * xq.s_row(r)[b];
  }
  return acc + offset_acc;
}

/*! \brief out[m, n] for every activation row m and weight rows n in [n0, n1). */
inline void matmul_rows_scalar(const uint8_t* w, int64_t row_bytes, int64_t qtype, int64_t n0,
                               int64_t n1, const QuantizedRows& xq, float* out, int64_t ldo) {
  for (int64_t m = 0; m < xq.rows; ++m) {
    for (int64_t n = n0; n < n1; ++n) out[m * ldo + n] = dot_row_scalar(w + n * row_bytes, qtype, xq, m);
  }
}

}  // namespace quant
}  // namespace freetoken

#include "freetoken/quant_kblocks.h"
