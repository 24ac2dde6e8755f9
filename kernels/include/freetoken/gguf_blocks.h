// GGUF block decoding shared by the GPU kernels (kernels/cuda/gguf_gemm.cu) and a host build
// that tests it against gguf's own numpy dequantizer (no GPU is needed for that check).
//
// Every reader decodes 8 consecutive weights of one block: group g covers weights 8g..8g+7.
// Layouts (bytes), with w the weight and q its stored integer:
//   Q4_0  (32 w,  18 B): f16 d | 16 B nibbles                    w = d * (q - 8)
//   Q4_1  (32 w,  20 B): f16 d | f16 m | 16 B nibbles            w = d * q + m
//   Q5_0  (32 w,  22 B): f16 d | 4 B qh | 16 B nibbles           w = d * (q - 16)
//   Q5_1  (32 w,  24 B): f16 d | f16 m | 4 B qh | 16 B nibbles   w = d * q + m
//   Q8_0  (32 w,  34 B): f16 d | 32 int8                         w = d * q
//     (a nibble byte j holds weight j low and weight j + 16 high; Q5's fifth bit of weight e
//     is bit e of qh read as a little-endian 32-bit word)
//   Q4_K (256 w, 144 B): f16 d | f16 dmin | 12 B packed 6-bit (scale, min) x 8 | 128 B nibbles
//   Q5_K (256 w, 176 B): as Q4_K, with 32 B of fifth bits before the nibbles
//     w = d * scale_s * q - dmin * min_s for sub-block s = w / 32; nibbles of sub-blocks 2c and
//     2c + 1 share bytes 32c..32c+31 (low, high); Q5_K's fifth bit of weight l of s is bit s of
//     byte l % 32.
//   Q6_K (256 w, 210 B): 128 B low nibbles | 64 B 2-bit highs | 16 int8 scales | f16 d
//     w = d * scale * (q - 32), 16 weights per scale; see decode8 below for the interleave.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIP__)
#define FT_GGUF_HD __host__ __device__ __forceinline__
#define FT_GGUF_UNROLL _Pragma("unroll")
#else
#define FT_GGUF_HD inline
#define FT_GGUF_UNROLL
#endif

namespace freetoken {
namespace gguf {

// GGML type ids (gguf.GGMLQuantizationType values).
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13,
              kQ6_K = 14;

template <int QT>
struct Block;
template <>
struct Block<kQ4_0> { static constexpr int kWeights = 32, kBytes = 18; };
template <>
struct Block<kQ4_1> { static constexpr int kWeights = 32, kBytes = 20; };
template <>
struct Block<kQ5_0> { static constexpr int kWeights = 32, kBytes = 22; };
template <>
struct Block<kQ5_1> { static constexpr int kWeights = 32, kBytes = 24; };
template <>
struct Block<kQ8_0> { static constexpr int kWeights = 32, kBytes = 34; };
template <>
struct Block<kQ4_K> { static constexpr int kWeights = 256, kBytes = 144; };
template <>
struct Block<kQ5_K> { static constexpr int kWeights = 256, kBytes = 176; };
template <>
struct Block<kQ6_K> { static constexpr int kWeights = 256, kBytes = 210; };

/*! \brief (weights, bytes) of a block of `qtype`; (0, 0) for a type this header does not read. */
FT_GGUF_HD void block_shape(int qtype, int* weights, int* bytes) {
  switch (qtype) {
    case kQ4_0: *weights = 32; *bytes = 18; return;
    case kQ4_1: *weights = 32; *bytes = 20; return;
    case kQ5_0: *weights = 32; *bytes = 22; return;
    case kQ5_1: *weights = 32; *bytes = 24; return;
    case kQ8_0: *weights = 32; *bytes = 34; return;
    case kQ4_K: *weights = 256; *bytes = 144; return;
    case kQ5_K: *weights = 256; *bytes = 176; return;
    case kQ6_K: *weights = 256; *bytes = 210; return;
    default: *weights = 0; *bytes = 0;
  }
}

/*! \brief Whether a row of `row_bytes` holds `k` weights of qtype as the GPU may keep them:
 * exactly their whole blocks, or those blocks padded with up to 15 bytes to whole 16-byte words
 * (weights.gpu_rows), so that every row starts 16-byte aligned. */
FT_GGUF_HD bool row_holds(int qtype, int64_t k, int64_t row_bytes) {
  int weights = 0, bytes = 0;
  block_shape(qtype, &weights, &bytes);
  if (weights == 0 || k <= 0 || k % weights != 0) return false;
  const int64_t data = k / weights * bytes;
  return row_bytes == data || row_bytes == (data + 15) / 16 * 16;
}

// IEEE half -> float by bit manipulation: the same code on host and device (no intrinsics, so
// the host test checks exactly what the GPU computes). Subnormals are exact; inf/nan kept.
FT_GGUF_HD float half_bits_to_float(uint32_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else {
    // subnormal or zero: man * 2^-24, exact in float
    float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  union { uint32_t u; float f; } cvt{bits};
  return cvt.f;
}

FT_GGUF_HD float half_at(const uint8_t* p) {
  return half_bits_to_float(static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8));
}

/*! \brief The 6-bit (scale, min) pair of sub-block s (0..7) of a Q4_K / Q5_K block. */
FT_GGUF_HD void scale_min_k4(const uint8_t* q, int s, int* sc, int* mn) {
  if (s < 4) {
    *sc = q[s] & 63;
    *mn = q[s + 4] & 63;
  } else {
    *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

/*! \brief The fields of the 32-weight nibble blocks (Q4_0, Q4_1, Q5_0, Q5_1): whether an f16
 * m follows d, whether qh holds fifth bits, the byte offsets of qh and of the nibbles, and
 * the offset taken from q where there is no m (w = d * (q - kOffset)). */
template <int QT>
struct Nibbles {
  static constexpr bool kMin = QT == kQ4_1 || QT == kQ5_1, kFifth = QT == kQ5_0 || QT == kQ5_1;
  static constexpr int kQh = kMin ? 4 : 2, kQs = kQh + (kFifth ? 4 : 0);
  static constexpr int kOffset = kFifth ? 16 : 8;
};

template <int QT>
constexpr bool kIsNibbles = QT == kQ4_0 || QT == kQ4_1 || QT == kQ5_0 || QT == kQ5_1;

/*! \brief out[0..8) = weights 8g..8g+7 of the block at `blk` (g < Block<QT>::kWeights / 8). */
template <int QT>
FT_GGUF_HD void decode8(const uint8_t* blk, int g, float* out) {
  if constexpr (kIsNibbles<QT>) {
    using N = Nibbles<QT>;
    const float d = half_at(blk);
    // -kOffset * d is exact (a power of two times an f16), so only the final add rounds
    const float m = N::kMin ? half_at(blk + 2) : -static_cast<float>(N::kOffset) * d;
    const uint8_t* qs = blk + N::kQs + (g & 1) * 8;
    const int shift = (g >> 1) * 4;
    // the fifth bits of weights 8g..8g+7 are the bits of qh's byte g
    const int qh = N::kFifth ? blk[N::kQh + g] : 0;
FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int q = ((qs[i] >> shift) & 0xF) | (((qh >> i) & 1) << 4);
      out[i] = d * static_cast<float>(q) + m;
    }
  } else if constexpr (QT == kQ8_0) {
    const float d = half_at(blk);
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2) + g * 8;
FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) out[i] = d * static_cast<float>(q[i]);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    const int s = g >> 2, l0 = (g & 3) * 8;
    int sc, mn;
    scale_min_k4(blk + 4, s, &sc, &mn);
    const float d = half_at(blk) * static_cast<float>(sc);
    const float m = half_at(blk + 2) * static_cast<float>(mn);
    const uint8_t* qs = blk + (QT == kQ5_K ? 48 : 16) + (s >> 1) * 32 + l0;
    const int shift = (s & 1) * 4;
FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) {
      int q = (qs[i] >> shift) & 0xF;
      if constexpr (QT == kQ5_K) q += ((blk[16 + l0 + i] >> s) & 1) << 4;
      out[i] = d * static_cast<float>(q) - m;
    }
  } else if constexpr (QT == kQ6_K) {
    // weight e = 128h + 32j + l (j 0..3, l 0..31): low nibble from byte 64h + 32(j&1) + l
    // (high half when j >= 2), two high bits from byte 128 + 32h + l at bit 2j, scale
    // 8h + l/16 + 2j.
    const int e0 = g * 8, h = e0 >> 7, j = (e0 >> 5) & 3, l0 = e0 & 31;
    const uint8_t* ql = blk + 64 * h + 32 * (j & 1) + l0;
    const uint8_t* qh = blk + 128 + 32 * h + l0;
    const int8_t sc = static_cast<int8_t>(blk[192 + 8 * h + (l0 >> 4) + 2 * j]);
    const float d = half_at(blk + 208) * static_cast<float>(sc);
    const int lshift = (j >> 1) * 4, hshift = 2 * j;
FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) {
      int q = ((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4);
      out[i] = d * static_cast<float>(q - 32);
    }
  }
}

// ---------------------------------------------------------------- dot products (the GEMV)
// dot32 folds the scales out of the sum: per 32-weight unit, sum(q * x) in float, then one
// scale and one offset times sum(x). Quants are read 4 at a time as 32-bit words (every field
// offset of these blocks is even, so two 16-bit loads make a word) and turned into floats
// exactly: on NVIDIA GPUs by placing the byte in the mantissa of 2^23 (one byte permute and one
// subtract, instead of a slower integer conversion).

FT_GGUF_HD uint32_t load_u32(const uint8_t* p) {
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__)
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
#else
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
#endif
}

/*! \brief Byte b (0..3) of v as a float (0..255, exact). */
template <int B>
FT_GGUF_HD float byte_float(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540 | B)) - 8388608.f;
#else
  return static_cast<float>((v >> (8 * B)) & 0xFFu);
#endif
}

/*! \brief Bits 0..3 of n as bit 4 of bytes 0..3: the fifth bits of 4 Q5_0 / Q5_1 quants.
 * The multiply places copies of n at bits 0, 7, 14 and 21, which cannot overlap (n < 16), so
 * bit b of n lands on bit 8b; then one mask and one shift. */
FT_GGUF_HD uint32_t fifth_bits(uint32_t n) {
  return (((n & 0xFu) * 0x00204081u) & 0x01010101u) << 4;
}

FT_GGUF_HD float dot4(uint32_t v, const float* x, float acc) {
  acc += byte_float<0>(v) * x[0];
  acc += byte_float<1>(v) * x[1];
  acc += byte_float<2>(v) * x[2];
  acc += byte_float<3>(v) * x[3];
  return acc;
}

/*! \brief Quants 4j..4j+3 (one per byte) of sub-block u of a Q4_K / Q5_K block. */
template <int QT>
FT_GGUF_HD uint32_t kquant_word(const uint8_t* blk, int u, int j) {
  const uint8_t* qs = blk + (QT == kQ5_K ? 48 : 16) + (u >> 1) * 32;
  uint32_t v = (load_u32(qs + 4 * j) >> ((u & 1) * 4)) & 0x0F0F0F0Fu;
  if constexpr (QT == kQ5_K) v |= ((load_u32(blk + 16 + 4 * j) >> u) & 0x01010101u) << 4;
  return v;
}

/*! \brief Quants 4i..4i+3 (0..63, one per byte) of unit u = 4h + j of a Q6_K block: weights
 * 128h + 32j + 4i.., low nibbles from ql, two high bits from qh (decode8's layout). */
FT_GGUF_HD uint32_t q6k_word(const uint8_t* blk, int u, int i) {
  const int h = u >> 2, j = u & 3;
  const uint8_t* ql = blk + 64 * h + 32 * (j & 1);
  const uint8_t* qh = blk + 128 + 32 * h;
  return ((load_u32(ql + 4 * i) >> ((j >> 1) * 4)) & 0x0F0F0F0Fu) |
         (((load_u32(qh + 4 * i) >> (2 * j)) & 0x03030303u) << 4);
}

/*!
 * \brief sum over the 32 weights of unit u of the block (u < Block<QT>::kWeights / 32) times
 * x[0..32); xlo / xhi are the sums of x[0..16) and x[16..32).
 */
template <int QT>
FT_GGUF_HD float dot32(const uint8_t* blk, int u, const float* x, float xlo, float xhi) {
  float s = 0.f;
  if constexpr (kIsNibbles<QT>) {
    using N = Nibbles<QT>;
    const uint8_t* qs = blk + N::kQs;
    const uint32_t qh = N::kFifth ? load_u32(blk + N::kQh) : 0u;
    FT_GGUF_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = load_u32(qs + 4 * j);
      s = dot4((v & 0x0F0F0F0Fu) | fifth_bits(qh >> (4 * j)), x + 4 * j, s);
      s = dot4(((v >> 4) & 0x0F0F0F0Fu) | fifth_bits(qh >> (16 + 4 * j)), x + 16 + 4 * j, s);
    }
    const float d = half_at(blk);
    return N::kMin ? d * s + half_at(blk + 2) * (xlo + xhi)
                   : d * (s - static_cast<float>(N::kOffset) * (xlo + xhi));
  } else if constexpr (QT == kQ8_0) {
    // int8 q read as q + 128 (flipping the sign bit), the 128 taken back with sum(x)
    FT_GGUF_UNROLL
    for (int j = 0; j < 8; ++j) s = dot4(load_u32(blk + 2 + 4 * j) ^ 0x80808080u, x + 4 * j, s);
    return half_at(blk) * (s - 128.f * (xlo + xhi));
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    int sc, mn;
    scale_min_k4(blk + 4, u, &sc, &mn);
    FT_GGUF_UNROLL
    for (int j = 0; j < 8; ++j) s = dot4(kquant_word<QT>(blk, u, j), x + 4 * j, s);
    return half_at(blk) * static_cast<float>(sc) * s -
           half_at(blk + 2) * static_cast<float>(mn) * (xlo + xhi);
  } else {  // Q6_K: unit u = 4h + j covers weights 128h + 32j + l (decode8's layout)
    const int h = u >> 2, j = u & 3;
    float s1 = 0.f;
    FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = q6k_word(blk, u, i);
      if (i < 4) {
        s = dot4(v, x + 4 * i, s);
      } else {
        s1 = dot4(v, x + 4 * i, s1);
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + 2 * j);
    return half_at(blk + 208) * (static_cast<float>(sc[0]) * (s - 32.f * xlo) +
                                 static_cast<float>(sc[1]) * (s1 - 32.f * xhi));
  }
}

// ---------------------------------------------------------------- int8 activations
// dot32_q8: the same sums against activations quantized to int8 in groups of 32 (gguf_gemv_q8):
// x holds a unit's 32 int8 values as 8 words, dx their scale and sx = dx * sum(x). Quants meet
// x four at a time in integer dot products; the block scales are applied once per unit (per 16
// weights for Q6_K).

/*! \brief a . b + c over 4 signed bytes of each (CUDA's dp4a; elsewhere 4 byte products). */
FT_GGUF_HD int dot4_i8(uint32_t a, uint32_t b, int c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(static_cast<int>(a), static_cast<int>(b), c);
#else
  // NOTE: HIP builds take this portable form; the gfx11/gfx12 dot instructions are not used.
  FT_GGUF_UNROLL
  for (int i = 0; i < 4; ++i) {
    c += static_cast<int>(static_cast<int8_t>(a >> (8 * i))) *
         static_cast<int>(static_cast<int8_t>(b >> (8 * i)));
  }
  return c;
#endif
}

template <int QT>
FT_GGUF_HD float dot32_q8(const uint8_t* blk, int u, const uint32_t* x, float dx, float sx) {
  int s = 0;
  if constexpr (kIsNibbles<QT>) {
    // quants 0..31 are non-negative signed bytes: dp4a takes them as they are
    using N = Nibbles<QT>;
    const uint8_t* qs = blk + N::kQs;
    const uint32_t qh = N::kFifth ? load_u32(blk + N::kQh) : 0u;
    FT_GGUF_UNROLL
    for (int j = 0; j < 4; ++j) {
      const uint32_t v = load_u32(qs + 4 * j);
      s = dot4_i8((v & 0x0F0F0F0Fu) | fifth_bits(qh >> (4 * j)), x[j], s);
      s = dot4_i8(((v >> 4) & 0x0F0F0F0Fu) | fifth_bits(qh >> (16 + 4 * j)), x[4 + j], s);
    }
    const float d = half_at(blk);
    return N::kMin ? d * dx * static_cast<float>(s) + half_at(blk + 2) * sx
                   : d * (dx * static_cast<float>(s) - static_cast<float>(N::kOffset) * sx);
  } else if constexpr (QT == kQ8_0) {
    FT_GGUF_UNROLL
    for (int j = 0; j < 8; ++j) s = dot4_i8(load_u32(blk + 2 + 4 * j), x[j], s);
    return half_at(blk) * dx * static_cast<float>(s);
  } else if constexpr (QT == kQ4_K || QT == kQ5_K) {
    int sc, mn;
    scale_min_k4(blk + 4, u, &sc, &mn);
    FT_GGUF_UNROLL
    for (int j = 0; j < 8; ++j) s = dot4_i8(kquant_word<QT>(blk, u, j), x[j], s);
    return half_at(blk) * static_cast<float>(sc) * dx * static_cast<float>(s) -
           half_at(blk + 2) * static_cast<float>(mn) * sx;
  } else {  // Q6_K, unit u = 4h + j as dot32; q - 32 with each half's sum of x
    const int h = u >> 2, j = u & 3;
    int s1 = 0, x0 = 0, x1 = 0;
    FT_GGUF_UNROLL
    for (int i = 0; i < 8; ++i) {
      const uint32_t v = q6k_word(blk, u, i);
      if (i < 4) {
        s = dot4_i8(v, x[i], s);
        x0 = dot4_i8(0x01010101u, x[i], x0);
      } else {
        s1 = dot4_i8(v, x[i], s1);
        x1 = dot4_i8(0x01010101u, x[i], x1);
      }
    }
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192 + 8 * h + 2 * j);
    return half_at(blk + 208) * dx *
           static_cast<float>(static_cast<int>(sc[0]) * (s - 32 * x0) +
                              static_cast<int>(sc[1]) * (s1 - 32 * x1));
  }
}

/*! \brief dot32_q8 by run-time type (the host test's entry point); 0 for an unknown type. */
inline float dot32_q8_any(const uint8_t* blk, int qtype, int u, const uint32_t* x, float dx,
                          float sx) {
  switch (qtype) {
    case kQ4_0: return dot32_q8<kQ4_0>(blk, u, x, dx, sx);
    case kQ4_1: return dot32_q8<kQ4_1>(blk, u, x, dx, sx);
    case kQ5_0: return dot32_q8<kQ5_0>(blk, u, x, dx, sx);
    case kQ5_1: return dot32_q8<kQ5_1>(blk, u, x, dx, sx);
    case kQ8_0: return dot32_q8<kQ8_0>(blk, u, x, dx, sx);
    case kQ4_K: return dot32_q8<kQ4_K>(blk, u, x, dx, sx);
    case kQ5_K: return dot32_q8<kQ5_K>(blk, u, x, dx, sx);
    case kQ6_K: return dot32_q8<kQ6_K>(blk, u, x, dx, sx);
    default: return 0.f;
  }
}

/*! \brief dot32 by run-time type (the host test's entry point); 0 for an unknown type. */
inline float dot32_any(const uint8_t* blk, int qtype, int u, const float* x) {
  float xlo = 0.f, xhi = 0.f;
  for (int i = 0; i < 16; ++i) {
    xlo += x[i];
    xhi += x[16 + i];
  }
  switch (qtype) {
    case kQ4_0: return dot32<kQ4_0>(blk, u, x, xlo, xhi);
    case kQ4_1: return dot32<kQ4_1>(blk, u, x, xlo, xhi);
    case kQ5_0: return dot32<kQ5_0>(blk, u, x, xlo, xhi);
    case kQ5_1: return dot32<kQ5_1>(blk, u, x, xlo, xhi);
    case kQ8_0: return dot32<kQ8_0>(blk, u, x, xlo, xhi);
    case kQ4_K: return dot32<kQ4_K>(blk, u, x, xlo, xhi);
    case kQ5_K: return dot32<kQ5_K>(blk, u, x, xlo, xhi);
    case kQ6_K: return dot32<kQ6_K>(blk, u, x, xlo, xhi);
    default: return 0.f;
  }
}

/*! \brief Weights [0, n) of a row of blocks of `qtype` into out (n a multiple of the block's
 * weights); false for a type this header does not read. The host test's entry point. */
inline bool dequantize_row(const uint8_t* row, int qtype, int64_t n, float* out) {
  int weights, bytes;
  block_shape(qtype, &weights, &bytes);
  if (weights == 0 || n % weights != 0) return false;
  for (int64_t b = 0; b < n / weights; ++b) {
    const uint8_t* blk = row + b * bytes;
    for (int g = 0; g < weights / 8; ++g) {
      float* o = out + b * weights + g * 8;
      switch (qtype) {
        case kQ4_0: decode8<kQ4_0>(blk, g, o); break;
        case kQ4_1: decode8<kQ4_1>(blk, g, o); break;
        case kQ5_0: decode8<kQ5_0>(blk, g, o); break;
        case kQ5_1: decode8<kQ5_1>(blk, g, o); break;
        case kQ8_0: decode8<kQ8_0>(blk, g, o); break;
        case kQ4_K: decode8<kQ4_K>(blk, g, o); break;
        case kQ5_K: decode8<kQ5_K>(blk, g, o); break;
        default: decode8<kQ6_K>(blk, g, o); break;
      }
    }
  }
  return true;
}

}  // namespace gguf
}  // namespace freetoken
