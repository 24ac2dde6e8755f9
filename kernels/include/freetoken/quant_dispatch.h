// Runtime ISA dispatch for the GGUF block kernels: the x86 SIMD bodies compiled once per ISA
// (quant_x86_body.h) plus the portable path (quant_blocks.h), behind one choice made from the
// CPU's features. Shared by every library that multiplies by quantized rows (quant_gemm, moe).
#pragma once

#include <immintrin.h>

#include <string>

#include "freetoken/cpu_common.h"
#include "freetoken/quant_blocks.h"

namespace freetoken {
namespace quant {

#define FT_QX_NS avx2
#define FT_QX_TARGET "avx2,fma,f16c"
#define FT_QX_VNNI 0
#include "freetoken/quant_x86_body.h"
#undef FT_QX_NS
#undef FT_QX_TARGET
#undef FT_QX_VNNI

#define FT_QX_NS avx512
#define FT_QX_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"
#define FT_QX_VNNI 1
#include "freetoken/quant_x86_body.h"
#undef FT_QX_NS
#undef FT_QX_TARGET
#undef FT_QX_VNNI

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "scalar";
}

/*! \brief The best ISA of this CPU; kAvx2 implies FMA and F16C as well. */
inline Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
    return Isa::kScalar;
  }();
  return isa;
}

/*! \brief "avx512" | "avx2" | "scalar" -> Isa; raises for an unknown name or one this CPU lacks. */
inline Isa parse_isa(const std::string& name) {
  Isa isa = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kScalar;
  TVM_FFI_ICHECK(name == isa_name(isa))
      << "unknown isa '" << name << "': use avx512, avx2 or scalar";
  TVM_FFI_ICHECK(isa <= best_isa())
      << "isa '" << name << "' is not supported by this CPU (best: " << isa_name(best_isa()) << ")";
  return isa;
}

/*!
 * \brief Quantize activation rows [r0, r1) of x (row stride k) into xq, in the form the kernels
 * of weight type `qtype` read (see activation_group).
 */
inline void quantize(Isa isa, int64_t qtype, const float* x, int64_t k, int64_t r0, int64_t r1,
                     const QuantizedRows& xq) {
  const int64_t group = activation_group(qtype);
  if (isa == Isa::kScalar) {
    for (int64_t r = r0; r < r1; ++r) {
      quantize_row_scalar(x + r * k, xq.blocks, group, xq.q + r * xq.blocks * kBlock,
                          xq.d + r * xq.blocks, xq.s + r * xq.blocks);
    }
  } else {
    avx2::quantize_rows(x, k, r0, r1, group, xq);  // AVX-512 machines run this AVX2 code too
  }
}

/*!
 * \brief out[m * ldo + n] = xq row m . dequant(weight row n) for every row m of xq and n in
 * [n0, n1); weight row n starts at w + n * row_bytes. Decode prefetches ahead up to row ldo.
 */
inline void matmul_rows(Isa isa, const uint8_t* w, int64_t row_bytes, int64_t qtype, int64_t n0,
                        int64_t n1, const QuantizedRows& xq, float* out, int64_t ldo) {
  if (isa == Isa::kAvx512) {
    avx512::matmul_rows(w, row_bytes, qtype, n0, n1, xq, out, ldo);
  } else if (isa == Isa::kAvx2) {
    avx2::matmul_rows(w, row_bytes, qtype, n0, n1, xq, out, ldo);
  } else {
    matmul_rows_scalar(w, row_bytes, qtype, n0, n1, xq, out, ldo);
  }
}

}  // namespace quant
}  // namespace freetoken
