// Weight-dequantizing products for scaled low-precision weights (FP8 e4m3 with a float32 scale
// grid, NVFP4 e2m1 with e4m3 scales per 16 columns), the weight read once in its own format:
//
//   W[n, k] = value(data)[n, k] * scales[n / bn, k / bk] * row_scale[n]
//
// scaled_gemv: out[T, N] = x[T, K] @ W^T for decode batches (T <= 8): one warp per weight
// row, 16 values per lane per step (16 FP8 bytes or 8 NVFP4 bytes), the block scale applied
// once per 16 products in registers, two steps in flight per warp to hide memory latency.
// scaled_dequantize: W into a float buffer [N, K], which prefill multiplies with the
// tensor cores through torch (cuBLAS).
#include "freetoken/cuda_common.cuh"
#include "freetoken/scaled_decode.cuh"

#include <type_traits>

namespace freetoken {
namespace {

constexpr int kFormatFp8 = kScaledFp8;
constexpr int kFormatNvfp4 = kScaledNvfp4;
constexpr int kMaxTokens = 8;
constexpr int kRowsPerBlock = 8;  // warps per block, one weight row each
constexpr int kChunk = kScaledChunk;

template <typename T, int FORMAT, int NT>
__device__ __forceinline__ void accumulate(const T* x, int64_t x_stride, int ntok, int col,
                                           const float (&w)[kChunk], float scale,
                                           float (&acc)[NT]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t < ntok) {
      float xv[kChunk];
      load_x16<T>(x + t * x_stride + col, xv);
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) dot += xv[i] * w[i];
      acc[t] += dot * scale;
    }
  }
}

template <typename T, int FORMAT, int NT>
__global__ void __launch_bounds__(kRowsPerBlock * kWarp)
    scaled_gemv_kernel(T* __restrict__ out, const T* __restrict__ x,
                       const uint8_t* __restrict__ data, ScaleGrid g, int ntok, int n, int k,
                       int64_t x_stride, int64_t out_stride) {
  int lane = threadIdx.x % kWarp;
  int row = blockIdx.x * kRowsPerBlock + threadIdx.x / kWarp;
  if (row >= n) return;
  int64_t row_bytes = FORMAT == kFormatFp8 ? k : k / 2;
  const uint8_t* wrow = data + row * row_bytes;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  constexpr int kStep = kWarp * kChunk;
  for (int col = lane * kChunk; col < k; col += 2 * kStep) {
    // both steps' bytes are requested before either is used: two loads in flight per lane
    float w0[kChunk], w1[kChunk];
    bool second = col + kStep < k;
    float s0 = scaled_decode16<FORMAT>(wrow, row, col, g, w0);
    float s1 = second ? scaled_decode16<FORMAT>(wrow, row, col + kStep, g, w1) : 0.f;
    accumulate<T, FORMAT, NT>(x, x_stride, ntok, col, w0, s0, acc);
    if (second) accumulate<T, FORMAT, NT>(x, x_stride, ntok, col + kStep, w1, s1, acc);
  }
  float rs = g.row_scale[row];
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < ntok) out[t * out_stride + row] = from_float<T>(v * rs);
  }
}

template <typename T, int FORMAT>
__global__ void scaled_dequantize_kernel(T* __restrict__ out, const uint8_t* __restrict__ data,
                                         ScaleGrid g, int n, int k) {
  int64_t chunks = static_cast<int64_t>(n) * (k / kChunk);
  int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += step) {
    int row = static_cast<int>(i / (k / kChunk));
    int col = static_cast<int>(i - static_cast<int64_t>(row) * (k / kChunk)) * kChunk;
    int64_t row_bytes = FORMAT == kFormatFp8 ? k : k / 2;
    float w[kChunk];
    float s = scaled_decode16<FORMAT>(data + row * row_bytes, row, col, g, w) * g.row_scale[row];
    constexpr int kPer = 16 / sizeof(T);
    T* dst = out + static_cast<int64_t>(row) * k + col;
#pragma unroll
    for (int part = 0; part < kChunk / kPer; ++part) {
      Vec<T, kPer> v;
#pragma unroll
      for (int e = 0; e < kPer; ++e) v.v[e] = from_float<T>(w[part * kPer + e] * s);
      store_vec<T, kPer>(dst + part * kPer, v);
    }
  }
}

// ---------------------------------------------------------------- host side

struct Layout {
  int n, k;
  ScaleGrid grid;
};

Layout check_weight(const TensorView& data, const TensorView& scales, const TensorView& row_scale,
                    int64_t format, int64_t bn, int64_t bk, int dev) {
  TVM_FFI_ICHECK(format == kFormatFp8 || format == kFormatNvfp4)
      << "format must be 0 (FP8 e4m3) or 1 (NVFP4), got " << format;
  check_gpu(data, "data", dev);
  check_gpu(scales, "scales", dev);
  check_gpu(row_scale, "row_scale", dev);
  check_dtype(data, kDLUInt, 8, "data", "uint8 (the weight's bytes)");
  check_dtype(row_scale, kDLFloat, 32, "row_scale", "float32");
  check_ndim(data, 2, "data");
  check_ndim(scales, 2, "scales");
  check_contiguous(data, "data");
  check_contiguous(scales, "scales");
  check_contiguous(row_scale, "row_scale");
  TVM_FFI_ICHECK(aligned16(data)) << "data must be 16-byte aligned";
  int64_t n = data.size(0);
  int64_t k = format == kFormatFp8 ? data.size(1) : 2 * data.size(1);
  TVM_FFI_ICHECK(k % kChunk == 0) << "the weight's columns (" << k << ") must be a multiple of 16";
  TVM_FFI_ICHECK(row_scale.numel() == n) << "row_scale must hold one value per row (" << n << ")";
  if (format == kFormatFp8) {
    check_dtype(scales, kDLFloat, 32, "scales", "float32 for FP8");
    TVM_FFI_ICHECK(bn >= 1 && bk >= 1 && (bk % kChunk == 0 || bk >= k))
        << "FP8 scale blocks must be >= 1 and cover a multiple of 16 columns, got " << bn
        << "x" << bk;
    TVM_FFI_ICHECK(scales.size(0) == ceil_div(n, bn) && scales.size(1) == ceil_div(k, bk))
        << "scales must be [" << ceil_div(n, bn) << ", " << ceil_div(k, bk) << "] for " << bn
        << "x" << bk << " blocks of a [" << n << ", " << k << "] weight";
  } else {
    check_dtype(scales, kDLUInt, 8, "scales", "uint8 (e4m3 bytes) for NVFP4");
    TVM_FFI_ICHECK(scales.size(0) == n && scales.size(1) == k / kChunk)
        << "NVFP4 scales must be [" << n << ", " << k / kChunk << "]";
    bn = 1;
    bk = kChunk;
  }
  ScaleGrid g{data_of<char>(scales),
              data_of<float>(row_scale), static_cast<int>(bn),
              static_cast<int>(bk < k ? bk : k), static_cast<int>(scales.size(1))};
  if (format == kFormatFp8 && bk >= k) g.bk = static_cast<int>(k);  // one block column
  return {static_cast<int>(n), static_cast<int>(k), g};
}

template <typename T, int FORMAT>
void launch_gemv(TensorView out, TensorView x, TensorView data, const Layout& w, RowView rx,
                 RowView ro, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(ceil_div(w.n, kRowsPerBlock)));
  int ntok = static_cast<int>(rx.rows);
  auto go = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    scaled_gemv_kernel<T, FORMAT, NT><<<grid, kRowsPerBlock * kWarp, 0, stream>>>(
        data_of<T>(out), data_of<T>(x), data_of<uint8_t>(data), w.grid, ntok, w.n, w.k,
        rx.stride, ro.stride);
  };
  if (ntok <= 1) go(std::integral_constant<int, 1>());
  else if (ntok <= 2) go(std::integral_constant<int, 2>());
  else if (ntok <= 4) go(std::integral_constant<int, 4>());
  else go(std::integral_constant<int, 8>());
  check_launch("scaled_gemv");
}

/*! \brief out[T, N] = x[T, K] @ dequant(W)^T for T <= 8 (decode); x, out bf16/f16/f32. */
void scaled_gemv(TensorView out, TensorView x, TensorView data, TensorView scales,
                 TensorView row_scale, int64_t format, int64_t block_n, int64_t block_k) {
  int dev = x.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(x, "x", dev);
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  Layout w = check_weight(data, scales, row_scale, format, block_n, block_k, dev);
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(rx.width == w.k && ro.width == w.n && rx.rows == ro.rows)
      << "x must be [T, " << w.k << "] and out [T, " << w.n << "]";
  TVM_FFI_ICHECK(rx.rows <= kMaxTokens) << "scaled_gemv takes at most " << kMaxTokens
                                        << " rows of x (use scaled_dequantize + a GEMM)";
  int64_t per = ft == FloatType::kF32 ? 4 : 8;
  TVM_FFI_ICHECK(aligned16(x) && rx.stride % per == 0) << "x rows must be 16-byte aligned";
  if (rx.rows == 0 || w.n == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (format == kFormatFp8) {
      launch_gemv<T, kFormatFp8>(out, x, data, w, rx, ro, stream);
    } else {
      launch_gemv<T, kFormatNvfp4>(out, x, data, w, rx, ro, stream);
    }
  });
}

/*! \brief out[N, K] = dequant(W) in out's float dtype (contiguous). */
void scaled_dequantize(TensorView out, TensorView data, TensorView scales, TensorView row_scale,
                       int64_t format, int64_t block_n, int64_t block_k) {
  int dev = data.device().device_id;
  check_gpu(out, "out", dev);
  FloatType ft = float_type(out, "out");
  check_contiguous(out, "out");
  TVM_FFI_ICHECK(aligned16(out)) << "out must be 16-byte aligned";
  Layout w = check_weight(data, scales, row_scale, format, block_n, block_k, dev);
  check_ndim(out, 2, "out");
  TVM_FFI_ICHECK(out.size(0) == w.n && out.size(1) == w.k)
      << "out must be [" << w.n << ", " << w.k << "]";
  if (w.n == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(out);
  int64_t chunks = static_cast<int64_t>(w.n) * (w.k / kChunk);
  int64_t blocks = ceil_div(chunks, 256);
  blocks = blocks < 65536 ? blocks : 65536;  // grid-stride beyond this
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (format == kFormatFp8) {
      scaled_dequantize_kernel<T, kFormatFp8><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
          data_of<T>(out), data_of<uint8_t>(data), w.grid, w.n, w.k);
    } else {
      scaled_dequantize_kernel<T, kFormatNvfp4>
          <<<static_cast<unsigned>(blocks), 256, 0, stream>>>(data_of<T>(out),
                                                              data_of<uint8_t>(data), w.grid,
                                                              w.n, w.k);
    }
  });
  check_launch("scaled_dequantize");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(scaled_gemv, freetoken::scaled_gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(scaled_dequantize, freetoken::scaled_dequantize);
