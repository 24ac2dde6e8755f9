// Small float products on the CPU: out[M, N] f32 = x[M, K] f32 @ w[N, K].T, w in f32, f16 or
// bf16, over the kernels' own thread pool (floatrows::float_rows per chunk of weight rows).
//
// It serves decode-sized float products and any product through a small weight (an MoE router,
// F32/F16 GGUF tensors, HF weights on the CPU) so those never wake the BLAS library's own
// threads: they spin for a while after each call and take the cores from this pool's workers
// (a 2-core machine lost ~30% of its MoE decode speed to it). Large products over large
// weights (an HF model's prefill) stay with BLAS.
#include <algorithm>

#include "freetoken/cpu_common.h"
#include "freetoken/float_rows.h"
#include "freetoken/quant_dispatch.h"

namespace freetoken {
namespace {

// w's dtype as float_rows' type id (cpu_common's float_type names a wrong dtype).
int64_t weight_type(const TensorView& w) {
  switch (float_type(w, "w")) {
    case FloatType::kF32: return floatrows::kF32;
    case FloatType::kF16: return floatrows::kF16;
    case FloatType::kBF16: return floatrows::kBF16;
  }
  return floatrows::kF32;
}

void float_matmul(TensorView out, TensorView x, TensorView w) {
  check_contiguous(x, "x");
  check_contiguous(w, "w");
  check_contiguous(out, "out");
  check_dtype(x, kDLFloat, 32, "x", "float32");
  check_dtype(out, kDLFloat, 32, "out", "float32");
  check_ndim(x, 2, "x");
  check_ndim(w, 2, "w");
  check_ndim(out, 2, "out");
  const int64_t wtype = weight_type(w);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TVM_FFI_ICHECK(w.size(1) == k) << "w must be [N, K=" << k << "] (x's last dim), got [" << n
                                 << ", " << w.size(1) << "]";
  TVM_FFI_ICHECK(out.size(0) == m && out.size(1) == n)
      << "out must be [" << m << ", " << n << "] (x rows, w rows)";
  if (m == 0 || n == 0) return;
  const int64_t row_bytes = k * floatrows::element_bytes(wtype);
  const uint8_t* wp = data_of<uint8_t>(w);
  const float* xp = data_of<float>(x);
  float* op = data_of<float>(out);
  const bool simd = quant::best_isa() != quant::Isa::kScalar;  // AVX2 + FMA + F16C
  floatrows::float_matmul_pool(simd, wp, row_bytes, wtype, n, xp, m, k, op);
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(float_matmul, freetoken::float_matmul);
