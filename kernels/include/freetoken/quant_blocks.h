// GGUF block formats read by the quantized CPU kernels, and the portable (scalar) path.
//
// Every format holds 32 weights per block:
//   Q4_0: f16 d, 16 bytes of nibbles            -> w = d * (q - 8)
//   Q4_1: f16 d, f16 m, 16 bytes of nibbles     -> w = d * q + m
//   Q8_0: f16 d, 32 int8                         -> w = d * q
// A nibble byte j holds element j in its low half and element j + 16 in its high half.
//
// Activations are quantized once per call to int8 per 32-block (scale dx, and sx = dx * sum q),
// so a block's dot product is integer: dw * dx * sum(qw * qx) + offset * sx, where the offset is
// m for Q4_1, -8 * dw for Q4_0 and 0 for Q8_0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace quant {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

inline int64_t block_bytes(int64_t qtype) {
  return qtype == kQ4_0 ? 18 : qtype == kQ4_1 ? 20 : qtype == kQ8_0 ? 34 : 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_float(h);
}

/*! \brief Activation rows quantized per 32-block; `blocks` blocks per row. */
struct QuantizedRows {
  int64_t rows = 0, blocks = 0;
  int8_t* q = nullptr;   // [rows][blocks * 32]
  float* d = nullptr;    // [rows][blocks] scale
  float* s = nullptr;    // [rows][blocks] scale * sum of the block's int8 values

  const int8_t* q_row(int64_t r) const { return q + r * blocks * kBlock; }
  const float* d_row(int64_t r) const { return d + r * blocks; }
  const float* s_row(int64_t r) const { return s + r * blocks; }
};

// Dequantizes one block of 32 weights (used by dequantize_rows and the scalar path's tests).
inline void dequantize_block(const uint8_t* blk, int64_t qtype, float* out) {
  const float d = half_at(blk);
  if (qtype == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) out[i] = d * q[i];
    return;
  }
  const uint8_t* qs = blk + (qtype == kQ4_1 ? 4 : 2);
  const float m = qtype == kQ4_1 ? half_at(blk + 2) : -8.f * d;
  for (int i = 0; i < 16; ++i) {
    out[i] = d * static_cast<float>(qs[i] & 0x0F) + m;
    out[i + 16] = d * static_cast<float>(qs[i] >> 4) + m;
  }
}

// ------------------------------------------------------------------ scalar path

inline void quantize_row_scalar(const float* x, int64_t blocks, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      int v = static_cast<int>(std::lrintf(xb[i] * inv));  // nearest-even, like cvtps2dq
      q[b * kBlock + i] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = scale;
    s[b] = scale * static_cast<float>(sum);
  }
}

inline float dot_row_scalar(const uint8_t* w, int64_t qtype, const QuantizedRows& xq,
                            int64_t r) {
  const int64_t bb = block_bytes(qtype);
  const int8_t* xrow = xq.q_row(r);
  float acc = 0.f, offset_acc = 0.f;
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* blk = w + b * bb;
    const int8_t* x = xrow + b * kBlock;
    const float dw = half_at(blk);
    int32_t dot = 0;
    if (qtype == kQ8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) dot += q[i] * x[i];
    } else {
      const uint8_t* qs = blk + (qtype == kQ4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) dot += (qs[i] & 0x0F) * x[i] + (qs[i] >> 4) * x[i + 16];
      const float offset = qtype == kQ4_1 ? half_at(blk + 2) : -8.f * dw;
      offset_acc += offset * xq.s_row(r)[b];
    }
    acc += dw * xq.d_row(r)[b] * static_cast<float>(dot);
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
