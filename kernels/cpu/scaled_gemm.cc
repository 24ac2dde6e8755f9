// FP8 weights on the CPU, read in their format (e4m3 codes with block, channel or tensor
// scales: scaled_cpu_args.h):
//
//   scaled_gemv:       out[T, N] f32 = x[T, K] f32 @ W.T for any T, over the kernels' thread
//                      pool (floatrows::float_matmul_pool: each 8 codes decoded to floats and
//                      scaled in registers, one byte read per weight);
//   scaled_dequantize: W into a float32 [N, K] buffer, for prefill's BLAS product.
//
// NVFP4 weights are dequantized at load on the CPU; both functions refuse them by name.
#include <algorithm>

#include "freetoken/cpu_common.h"
#include "freetoken/float_rows.h"
#include "freetoken/quant_dispatch.h"
#include "freetoken/scaled_cpu_args.h"

namespace freetoken {
namespace scaled {
namespace {

void scaled_gemv(TensorView out, TensorView x, TensorView data, TensorView scales,
                 TensorView row_scale, int64_t format, int64_t block_n, int64_t block_k) {
  check_format(format);
  const Fp8Layout w = check_fp8(data, scales, row_scale, block_n, block_k, 2, "data", "scales",
                                "row_scale");
  check_contiguous(x, "x");
  check_contiguous(out, "out");
  check_dtype(x, kDLFloat, 32, "x", "float32");
  check_dtype(out, kDLFloat, 32, "out", "float32");
  check_ndim(x, 2, "x");
  check_ndim(out, 2, "out");
  const int64_t m = x.size(0);
  TVM_FFI_ICHECK(x.size(1) == w.k) << "x must be [T, K=" << w.k << "] (data's columns), got [" << m
                                   << ", " << x.size(1) << "]";
  TVM_FFI_ICHECK(out.size(0) == m && out.size(1) == w.n)
      << "out must be [" << m << ", " << w.n << "] (x rows, data rows)";
  if (m == 0 || w.n == 0) return;
  const floatrows::BlockScales s = w.scales(0, 0);
  floatrows::float_matmul_pool(quant::best_isa() != quant::Isa::kScalar, w.data, w.k,
                               floatrows::kE4M3, w.n, data_of<float>(x), m, w.k,
                               data_of<float>(out), &s);
}

void scaled_dequantize(TensorView out, TensorView data, TensorView scales, TensorView row_scale,
                       int64_t format, int64_t block_n, int64_t block_k) {
  check_format(format);
  const Fp8Layout w = check_fp8(data, scales, row_scale, block_n, block_k, 2, "data", "scales",
                                "row_scale");
  check_contiguous(out, "out");
  check_dtype(out, kDLFloat, 32, "out", "float32 on the CPU");
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == w.n && out.size(1) == w.k)
      << "out must be [" << w.n << ", " << w.k << "] like data";
  float* op = data_of<float>(out);
  parallel_for(w.n, std::max<int64_t>(1, 16384 / std::max<int64_t>(w.k, 1)),
               [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* grid = w.grid + r / w.bn * w.grid_cols;
      const uint8_t* codes = w.data + r * w.k;
      const float rs = w.row_scale[r] * floatrows::kE4M3HalfScale;
      for (int64_t j = 0; j < w.k; ++j) {
        // the product in the reference's order: code * grid, then * row scale (one rounding
        // each; the 256 is a power of two)
        op[r * w.k + j] = f16_to_float(floatrows::e4m3_half_bits(codes[j])) * grid[j / w.bk] * rs;
      }
    }
  });
}

}  // namespace
}  // namespace scaled
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(scaled_gemv, freetoken::scaled::scaled_gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scaled_dequantize, freetoken::scaled::scaled_dequantize);
