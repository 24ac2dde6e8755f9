// FP8 weights as the CPU kernels take them (scaled_gemv, scaled_dequantize, moe_experts_scaled):
// uint8 e4m3 codes [..., N, K], a float32 scale grid [..., ceil(N / bn), ceil(K / bk)] and
// float32 row scales [..., N] (models/quant/scaled.py's rule). One check builds the layout;
// every message names the argument and the shape it must have.
#pragma once

#include <string>

#include "freetoken/cpu_common.h"
#include "freetoken/float_rows.h"

namespace freetoken {
namespace scaled {

constexpr int64_t kFormatFp8 = 0, kFormatNvfp4 = 1;

/*! \brief One FP8 tensor of `slots` matrices [N, K] (slots 1: a plain 2-D weight). */
struct Fp8Layout {
  const uint8_t* data = nullptr;
  const float* grid = nullptr;
  const float* row_scale = nullptr;
  int64_t slots = 1, n = 0, k = 0, bn = 1, bk = 1, grid_rows = 1, grid_cols = 1;

  /*! \brief The scales of matrix `slot`, for float_rows calls whose first row is `row0`. */
  floatrows::BlockScales scales(int64_t slot, int64_t row0) const {
    floatrows::BlockScales s;
    s.grid = grid + slot * grid_rows * grid_cols;
    s.grid_cols = grid_cols;
    s.bn = bn;
    s.bk = bk;
    s.row_scale = row_scale + slot * n;
    s.row0 = row0;
    return s;
  }
};

inline void check_format(int64_t format) {
  TVM_FFI_ICHECK(format == kFormatFp8 || format == kFormatNvfp4)
      << "format must be 0 (FP8 e4m3) or 1 (NVFP4), got " << format;
  TVM_FFI_ICHECK(format == kFormatFp8)
      << "NVFP4 weights have no CPU kernel: the CPU dequantizes them at load";
}

/*!
 * \brief Checks an FP8 tensor of `ndim` dims (2: [N, K]; 3: [S, N, K]) with its scales and
 * row scales, named `data`, `scales`, `rows` in the messages.
 */
inline Fp8Layout check_fp8(const TensorView& data, const TensorView& scales,
                           const TensorView& row_scale, int64_t bn, int64_t bk, int ndim,
                           const std::string& data_name, const std::string& scales_name,
                           const std::string& rows_name) {
  check_contiguous(data, data_name.c_str());
  check_contiguous(scales, scales_name.c_str());
  check_contiguous(row_scale, rows_name.c_str());
  check_dtype(data, kDLUInt, 8, data_name.c_str(), "uint8 (e4m3 codes)");
  check_dtype(scales, kDLFloat, 32, scales_name.c_str(), "float32");
  check_dtype(row_scale, kDLFloat, 32, rows_name.c_str(), "float32");
  check_ndim(data, ndim, data_name.c_str());
  check_ndim(scales, ndim, scales_name.c_str());
  Fp8Layout w;
  w.slots = ndim == 3 ? data.size(0) : 1;
  w.n = data.size(ndim - 2);
  w.k = data.size(ndim - 1);
  TVM_FFI_ICHECK(w.k % 8 == 0) << data_name << "'s columns (" << w.k
                               << ") must be a multiple of 8";
  TVM_FFI_ICHECK(bn >= 1 && bk >= 1 && (bk % 8 == 0 || bk >= w.k))
      << data_name << ": FP8 scale blocks must be >= 1 and cover a multiple of 8 columns (or "
      << "the whole row), got " << bn << "x" << bk;
  w.bn = bn;
  w.bk = bk < w.k ? bk : w.k;  // one block column
  w.grid_rows = (w.n + bn - 1) / bn;
  w.grid_cols = (w.k + w.bk - 1) / w.bk;
  const bool grid_ok = (ndim == 2 || scales.size(0) == w.slots) &&
                       scales.size(ndim - 2) == w.grid_rows &&
                       scales.size(ndim - 1) == w.grid_cols;
  TVM_FFI_ICHECK(grid_ok) << scales_name << " must be [" << (ndim == 3 ? std::to_string(w.slots) + ", " : "")
                          << w.grid_rows << ", " << w.grid_cols << "] for " << bn << "x" << bk
                          << " blocks of " << data_name << "'s [" << w.n << ", " << w.k
                          << "] matrices";
  TVM_FFI_ICHECK(row_scale.numel() == w.slots * w.n)
      << rows_name << " must hold one value per row of " << data_name << " ("
      << w.slots * w.n << "), got " << row_scale.numel();
  w.data = data_of<uint8_t>(data);
  w.grid = data_of<float>(scales);
  w.row_scale = data_of<float>(row_scale);
  return w;
}

}  // namespace scaled
}  // namespace freetoken
