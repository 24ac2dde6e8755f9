// What the decode GEMVs over quantized weights share (kernels/cuda/quant_gemv.cu for GGUF,
// kernels/cuda/fp8_gemv.cu for FP8): the launch shape and the choice of R, the weight rows a
// warp owns, and NT, the token rows a kernel is built for.
#pragma once

#include <cstdint>
#include <type_traits>

#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace quant_gemv {

constexpr int kMaxTokens = 8, kWarps = 4;  // token rows at most; warps per block

using Word = Vec<uint32_t, 4>;  // the 16 bytes one lane loads

// R for rows = 0: one row per warp for a single token (the most warps, so the most bytes in
// flight), two for more tokens (each x load then serves two weight rows). R = 4 with 4-8
// tokens needs more than 255 registers in the GGUF kernel (sm_90a ptxas: K-quants spill), so
// it is only a variant for the sweep.
inline int auto_rows(int64_t ntok) { return ntok <= 1 ? 1 : 2; }

inline int token_bucket(int64_t ntok) { return ntok <= 1 ? 1 : ntok <= 4 ? 4 : 8; }

template <typename F>
inline void with_rows_tokens(int64_t rows, int64_t ntok, F&& f) {
  auto by_tokens = [&](auto r) {
    switch (token_bucket(ntok)) {
      case 1: f(r, std::integral_constant<int, 1>()); break;
      case 4: f(r, std::integral_constant<int, 4>()); break;
      default: f(r, std::integral_constant<int, 8>()); break;
    }
  };
  switch (rows == 0 ? auto_rows(ntok) : rows) {
    case 1: by_tokens(std::integral_constant<int, 1>()); break;
    case 2: by_tokens(std::integral_constant<int, 2>()); break;
    default: by_tokens(std::integral_constant<int, 4>()); break;
  }
}

#if !defined(FT_HOST_EMULATION)  // the emulated tests build the kernels, not the checks
inline void check_rows(int64_t rows) {
  TVM_FFI_ICHECK(rows == 0 || rows == 1 || rows == 2 || rows == 4)
      << "rows (weight rows per warp) must be 0 (automatic), 1, 2 or 4, got " << rows;
}
#endif

}  // namespace quant_gemv
}  // namespace freetoken
