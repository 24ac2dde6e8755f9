// fp8_gemv: the decode GEMV (T <= 8 activation rows) over FP8 e4m3 weights with a float32
// scale grid whose block width is a power of two or the whole row (128 x 128 blocks,
// per-channel, per-tensor), written to stream the weight bytes at the memory's rate: a warp
// owns R weight rows and keeps 4 / R 16-byte loads per row and lane in flight (the 32 lanes of
// one load cover 512 contiguous bytes), decodes four bytes at a time (freetoken/fp8_words.h,
// host-tested), looks the block scale up once per 16 weights with a shift, and each activation
// value a lane loads serves the R rows.
//
// scaled_gemv (scaled_gemm.cu) stays as it was: the model picks one or the other by
// FREETOKEN_QUANT_GEMV, and `rows` = 0 lets the kernel choose R.
#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_words.h"
#include "freetoken/quant_gemv.cuh"
#include "freetoken/scaled_decode.cuh"

namespace freetoken {
namespace {

using namespace quant_gemv;

struct Fp8Grid {
  const float* scales;     // [ceil(n / bn), cols]
  const float* row_scale;  // [n]
  int bn, bk_shift, cols;  // a scale covers bn rows and 2^bk_shift columns
};

// U: 16-byte words per lane and row in flight per step.
template <typename T, int R, int NT>
__global__ void __launch_bounds__(kWarps * kWarp)
    fp8_gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                    const uint8_t* __restrict__ data, Fp8Grid g, int ntok, int n, int k,
                    int64_t ldx, int64_t ldo) {
  constexpr int U = R >= 4 ? 1 : 4 / R, kStep = kWarp * 16 * U;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int n0 = (blockIdx.x * kWarps + warp) * R;
  if (n0 >= n) return;
  const uint8_t* rows[R];
  const float* srow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = n0 + r < n ? n0 + r : n - 1;
    rows[r] = data + static_cast<int64_t>(row) * k;
    srow[r] = g.scales + static_cast<int64_t>(row / g.bn) * g.cols;
  }
  float acc[R][NT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
  for (int base = 0; base < k; base += kStep) {
    Word q[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * kWarp + lane) * 16;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (col < k)
          q[r][u] = load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(rows[r] + col));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * kWarp + lane) * 16;
      if (col >= k) break;
      float wv[R][16], sc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int j = 0; j < 4; ++j) fp8::e4m3x4_div256(q[r][u].v[j], wv[r] + 4 * j);
        sc[r] = srow[r][col >> g.bk_shift];
      }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= ntok) break;
        float xv[16];
        load_x16<T>(x + t * ldx + col, xv);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float d = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) d += xv[i] * wv[r][i];
          acc[r][t] += d * sc[r];
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= ntok) break;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0 && n0 + r < n)
        out[t * ldo + n0 + r] = from_float<T>(v * 256.f * g.row_scale[n0 + r]);
    }
  }
}

/*! \brief log2(bk) for a power-of-two block width, 30 for a block spanning the row (one scale
 * column), -1 otherwise. */
int block_shift(int64_t bk, int64_t k) {
  if (bk >= k) return 30;
  for (int s = 0; s < 30; ++s)
    if ((int64_t{1} << s) == bk) return s;
  return -1;
}

/*! \brief out[T, N] = x[T, K] @ W.T for T <= 8, W[n, c] = e4m3(data[n, c]) * scales[n / bn,
 * c / bk] * row_scale[n]; x, out bf16 or f16; bk a power of two (>= 16) or >= K. */
void fp8_gemv(TensorView out, TensorView x, TensorView data, TensorView scales,
              TensorView row_scale, int64_t block_n, int64_t block_k, int64_t rows) {
  const int dev = x.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(data, "data", dev);
  check_gpu(scales, "scales", dev);
  check_gpu(row_scale, "row_scale", dev);
  check_same_dtype(out, x, "out", "x");
  FloatType ft = float_type(x, "x");
  TVM_FFI_ICHECK(ft != FloatType::kF32) << "fp8_gemv takes bf16 or f16 x (scaled_gemv takes f32)";
  check_dtype(data, kDLUInt, 8, "data", "uint8 (the e4m3 bytes)");
  check_dtype(scales, kDLFloat, 32, "scales", "float32");
  check_dtype(row_scale, kDLFloat, 32, "row_scale", "float32");
  check_ndim(data, 2, "data");
  check_ndim(scales, 2, "scales");
  check_contiguous(data, "data");
  check_contiguous(scales, "scales");
  check_contiguous(row_scale, "row_scale");
  check_rows(rows);
  const int64_t n = data.size(0), k = data.size(1);
  TVM_FFI_ICHECK(k % 16 == 0 && aligned16(data)) << "data rows must be 16-byte aligned "
                                                    "multiples of 16 columns, got " << k;
  const int shift = block_shift(block_k, k);
  TVM_FFI_ICHECK(block_n >= 1 && shift >= 4)
      << "fp8_gemv takes scale blocks of >= 1 rows and a power of two >= 16 columns (or the "
         "whole row), got " << block_n << "x" << block_k;
  const int64_t grid_cols = shift == 30 ? 1 : ceil_div(k, block_k);
  TVM_FFI_ICHECK(scales.size(0) == ceil_div(n, block_n) && scales.size(1) == grid_cols)
      << "scales must be [" << ceil_div(n, block_n) << ", " << grid_cols << "] for " << block_n
      << "x" << block_k << " blocks of a [" << n << ", " << k << "] weight";
  TVM_FFI_ICHECK(row_scale.numel() == n) << "row_scale must hold one value per row (" << n << ")";
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(rx.width == k && ro.width == n && rx.rows == ro.rows)
      << "x must be [T, " << k << "] and out [T, " << n << "]";
  TVM_FFI_ICHECK(rx.rows <= kMaxTokens) << "fp8_gemv takes at most " << kMaxTokens << " rows of x";
  TVM_FFI_ICHECK(aligned16(x) && rx.stride % 8 == 0) << "x rows must be 16-byte aligned";
  if (rx.rows == 0 || n == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  const Fp8Grid g{data_of<float>(scales), data_of<float>(row_scale),
                  static_cast<int>(block_n < n ? block_n : n), shift,
                  static_cast<int>(scales.size(1))};
  const int ntok = static_cast<int>(rx.rows);
  with_rows_tokens(rows, rx.rows, [&](auto r, auto nt) {
    constexpr int R = decltype(r)::value, NT = decltype(nt)::value;
    const dim3 grid(static_cast<unsigned>(ceil_div(n, kWarps * R)));
    if (ft == FloatType::kBF16) {
      fp8_gemv_kernel<bf16, R, NT><<<grid, kWarps * kWarp, 0, stream>>>(
          data_of<bf16>(out), data_of<bf16>(x), data_of<uint8_t>(data), g, ntok,
          static_cast<int>(n), static_cast<int>(k), rx.stride, ro.stride);
    } else {
      fp8_gemv_kernel<f16, R, NT><<<grid, kWarps * kWarp, 0, stream>>>(
          data_of<f16>(out), data_of<f16>(x), data_of<uint8_t>(data), g, ntok,
          static_cast<int>(n), static_cast<int>(k), rx.stride, ro.stride);
    }
  });
  check_launch("fp8_gemv");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(fp8_gemv, freetoken::fp8_gemv);
