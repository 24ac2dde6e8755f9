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

// Weight bytes a chunk holds at least: fewer chunks than that cost more in hand-offs than they
// gain in balance (as quant_gemm's decode chunks).
constexpr int64_t kChunkBytes = 65536;

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
  const int64_t threads = thread_pool().num_threads();
  // Tasks of (row block of x, chunk of weight rows): decode splits the weights; a longer x
  // (a prefill through a small weight, like an MoE router) splits its rows as well.
  const int64_t chunks = std::clamp<int64_t>(n * row_bytes / kChunkBytes, 1, threads * 8);
  // whole tiles of 4 weight rows
  const int64_t grain = (std::max<int64_t>(4, (n + chunks - 1) / chunks) + 3) / 4 * 4;
  const int64_t n_tasks = (n + grain - 1) / grain;
  // x rows per task: about 4 tasks a thread, at least 8, even (float_rows takes 2 at a time)
  const int64_t rows_per_task = (m + threads * 4 - 1) / (threads * 4);
  const int64_t m_grain = std::max<int64_t>(8, (rows_per_task + 1) / 2 * 2);
  const int64_t m_tasks = (m + m_grain - 1) / m_grain;
  parallel_for(m_tasks * n_tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t m0 = t / n_tasks * m_grain, m1 = std::min(m, m0 + m_grain);
      const int64_t n0 = t % n_tasks * grain, n1 = std::min(n, n0 + grain);
      floatrows::float_rows(simd, wp, row_bytes, wtype, n0, n1, xp + m0 * k, k, m1 - m0, k,
                            op + m0 * n, n);
    }
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(float_matmul, freetoken::float_matmul);
