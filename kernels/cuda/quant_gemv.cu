// gguf_gemv: the decode GEMV (T <= 8 activation rows) over GGUF Q4_0 / Q5_0 / Q5_1 / Q8_0 /
// Q4_K / Q6_K rows whose byte length is a multiple of 16 (K a multiple of 64 for Q5_1, 256 for
// Q4_0, Q5_0, Q8_0 and Q4_K, 2048 for Q6_K), written to stream the weight bytes at the
// memory's rate. A warp owns R weight rows; it loads a chunk of whole blocks of each (about
// 4 KB per warp) in 16-byte loads in which its 32 lanes cover 512 contiguous bytes, stages the
// chunk from registers into shared memory, issues the loads of the next chunk, then decodes
// the staged one with the host-tested gguf::dot32 (scales applied once per 32 weights, f32
// sums); each activation value a lane loads serves the warp's R rows.
//
// gguf_matmul (gguf_gemm.cu) stays as it was: the model picks one or the other by
// FREETOKEN_QUANT_GEMV, and `rows` = 0 lets the kernel choose R.
#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"
#include "freetoken/gguf_stage.cuh"
#include "freetoken/quant_gemv.cuh"

namespace freetoken {
namespace {

using gguf::Block;
using gguf_stage::GgufStage;
using namespace quant_gemv;

__device__ __forceinline__ void load_x32(const bf16* p, float* xv, float* xlo, float* xhi) {
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    Vec<bf16, 8> v = load_vec<bf16, 8>(p + 8 * i);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      xv[8 * i + e] = to_float(v.v[e]);
      if (i < 2) lo += xv[8 * i + e]; else hi += xv[8 * i + e];
    }
  }
  *xlo = lo;
  *xhi = hi;
}

// out[t, n] for n in the warp's R rows; NT: token rows the kernel is built for (ntok <= NT).
template <int QT, int R, int NT>
__global__ void __launch_bounds__(kWarps * kWarp)
    gguf_gemv_kernel(void* out, bool out_f32, const bf16* __restrict__ x,
                     const uint8_t* __restrict__ w, int ntok, int64_t n, int64_t k,
                     int64_t row_bytes, int64_t ldx, int64_t ldo) {
  using B = Block<QT>;
  using Stage = GgufStage<QT, R>;
  __shared__ __attribute__((aligned(16))) uint8_t smem[kWarps][R * Stage::kChunk];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * R;
  if (n0 >= n) return;  // whole warps leave: the kernel only synchronises within a warp
  const uint8_t* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = w + (n0 + r < n ? n0 + r : n - 1) * row_bytes;
  float acc[R][NT] = {};
  Stage stage;
  const int bytes = static_cast<int>(row_bytes < Stage::kChunk ? row_bytes : Stage::kChunk);
  stage.load(rows, 0, bytes, lane);
  gguf_stage::for_each_unit(stage, rows, row_bytes, bytes, smem[warp], lane,
                            [&](int blk, int64_t col, int u) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= ntok) break;
      float xv[32], xlo, xhi;
      load_x32(x + t * ldx + col, xv, &xlo, &xhi);
#pragma unroll
      for (int r = 0; r < R; ++r)
        acc[r][t] += gguf::dot32<QT>(smem[warp] + r * Stage::kChunk + blk * B::kBytes, u, xv,
                                     xlo, xhi);
    }
  });
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= ntok) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r][t]);
      if (lane != 0 || n0 + r >= n) continue;
      if (out_f32) {
        static_cast<float*>(out)[t * ldo + n0 + r] = v;
      } else {
        static_cast<bf16*>(out)[t * ldo + n0 + r] = from_float<bf16>(v);
      }
    }
  }
}

#if !defined(FT_HOST_EMULATION)  // tests/kernel/gguf_gemv_emu.cc runs the kernel above alone
/*! \brief out[T, N] = x[T, K] @ dequant(qweight).T for T <= 8; x bf16 (16-byte aligned rows),
 * qweight uint8 [N, row_bytes] of Q4_0 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K blocks, row_bytes a
 * multiple of 16 (16-byte aligned), out f32 or bf16 with contiguous rows; rows: weight rows per
 * warp. */
void gguf_gemv(TensorView out, TensorView x, TensorView qweight, int64_t qtype, int64_t rows) {
  const int dev = qweight.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(x, "x", dev);
  check_gpu(qweight, "qweight", dev);
  check_dtype(x, kDLBfloat, 16, "x", "bfloat16");
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_ndim(x, 2, "x");
  check_ndim(out, 2, "out");
  check_ndim(qweight, 2, "qweight");
  check_contiguous(qweight, "qweight");
  check_rows(rows);
  TVM_FFI_ICHECK(qtype == gguf::kQ4_0 || qtype == gguf::kQ5_0 || qtype == gguf::kQ5_1 ||
                 qtype == gguf::kQ8_0 || qtype == gguf::kQ4_K || qtype == gguf::kQ6_K)
      << "gguf_gemv reads Q4_0 (2), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12) and Q6_K (14), got "
      << "qtype " << qtype;
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  int weights = 0, bytes = 0;
  gguf::block_shape(static_cast<int>(qtype), &weights, &bytes);
  const int64_t n = qweight.size(0), k = rx.width, rb = qweight.size(1);
  TVM_FFI_ICHECK(gguf::row_holds(static_cast<int>(qtype), k, rb))
      << "qweight rows must hold " << k << " weights: " << k / weights * bytes << " bytes (or "
      << "those padded to 16-byte words), got " << rb;
  TVM_FFI_ICHECK(rb % 16 == 0 && aligned16(qweight))
      << "gguf_gemv needs 16-byte aligned rows of a multiple of 16 bytes (got " << rb
      << "); gguf_matmul takes any row";
  TVM_FFI_ICHECK(ro.rows == rx.rows && ro.width == n)
      << "out must be [" << rx.rows << ", " << n << "] (x rows, qweight rows)";
  TVM_FFI_ICHECK(rx.rows <= kMaxTokens) << "gguf_gemv takes at most " << kMaxTokens
                                        << " rows of x (gguf_matmul takes more)";
  TVM_FFI_ICHECK(rx.stride % 8 == 0 && aligned16(x)) << "x rows must start 16-byte aligned";
  bool f32 = has_dtype(out, kDLFloat, 32);
  TVM_FFI_ICHECK(f32 || has_dtype(out, kDLBfloat, 16))
      << "out must be float32 or bfloat16, got " << dtype_name(out.dtype());
  if (rx.rows == 0 || n == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(qweight);
  const int ntok = static_cast<int>(rx.rows);
  with_rows_tokens(rows, rx.rows, [&](auto r, auto nt) {
    constexpr int R = decltype(r)::value, NT = decltype(nt)::value;
    const dim3 grid(static_cast<unsigned>(ceil_div(n, kWarps * R)));
    auto go = [&](auto kernel) {
      kernel<<<grid, kWarps * kWarp, 0, stream>>>(data_of<char>(out), f32, data_of<bf16>(x),
                                                  data_of<uint8_t>(qweight), ntok, n, k, rb,
                                                  rx.stride, ro.stride);
    };
    switch (qtype) {
      case gguf::kQ4_0: go(gguf_gemv_kernel<gguf::kQ4_0, R, NT>); break;
      case gguf::kQ5_0: go(gguf_gemv_kernel<gguf::kQ5_0, R, NT>); break;
      case gguf::kQ5_1: go(gguf_gemv_kernel<gguf::kQ5_1, R, NT>); break;
      case gguf::kQ8_0: go(gguf_gemv_kernel<gguf::kQ8_0, R, NT>); break;
      case gguf::kQ4_K: go(gguf_gemv_kernel<gguf::kQ4_K, R, NT>); break;
      default: go(gguf_gemv_kernel<gguf::kQ6_K, R, NT>); break;
    }
  });
  check_launch("gguf_gemv");
}
#endif  // !FT_HOST_EMULATION

}  // namespace
}  // namespace freetoken

#if !defined(FT_HOST_EMULATION)
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gguf_gemv, freetoken::gguf_gemv);
#endif
