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
//
// fp8_gemv_fused is the same kernel with the fused decode step's prologue and epilogues
// (forward/fused_decode.py, FREETOKEN_QUANT_GEMV=v3): x RMS-normed on the fly (rounded where
// the unfused rms_norm stores it), then + bias, residual += (o, down) or SwiGLU over the gate
// and up rows n and I + n. tests/kernel/fp8_gemv_emu.cc runs the kernel part on CPU threads.
#include <type_traits>

#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_words.h"
#include "freetoken/gemv_knobs.cuh"
#include "freetoken/gemv_prologue.cuh"
#include "freetoken/quant_gemv.cuh"
#include "freetoken/scaled_decode.cuh"

namespace freetoken {
namespace fp8_kernel {

using namespace quant_gemv;

enum Mode : int { kStore = 0, kAddResidual = 1, kSwiGLU = 2 };

struct Fp8Grid {
  const float* scales;     // [ceil(rows / bn), cols]
  const float* row_scale;  // [rows]
  int bn, bk_shift, cols;  // a scale covers bn rows and 2^bk_shift columns
};

struct Args {
  void* out;          // [T, ldo] of T (the residual for kAddResidual)
  const void* x;      // [T, ldx] of T
  const uint8_t* data;  // [N, K] e4m3 bytes (kSwiGLU: [2N, K], gate rows then up rows)
  Fp8Grid g;
  const void* bias;   // [N] of T or null (kStore)
  const void* norm;   // [K] of T: the RMSNorm weight of the prologue, or null
  int ntok, n, k;     // n: output columns (I for SwiGLU)
  int64_t ldx, ldo;
  float eps;
};

// out[t, n] for the warp's R output rows (kSwiGLU: R gate rows and their R up rows); U: 16-byte
// words per lane and weight row in flight per step.
template <typename T, int R, int NT, int MODE, bool NORM>
__global__ void __launch_bounds__(kWarps * kWarp) fp8_gemv_kernel(Args a) {
  constexpr int NW = MODE == kSwiGLU ? 2 * R : R;
  constexpr int U = NW >= 4 ? 1 : 4 / NW, kStep = kWarp * 16 * U;
  __shared__ float inv_rms[NT];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int n0 = (blockIdx.x * kWarps + warp) * R;
  wait_for_inputs();  // a programmatic dependent reads x only once its producer has finished
  if constexpr (NORM) {
    block_inv_rms<T, NT, kWarps * kWarp>(static_cast<const T*>(a.x), a.ldx, a.k, a.ntok, a.eps,
                                        inv_rms);
  }
  if (n0 >= a.n) return;  // whole warps: nothing below synchronises the block
  const T* x = static_cast<const T*>(a.x);
  const uint8_t* rows[NW];
  const float* srow[NW];
  int rowi[NW];
#pragma unroll
  for (int r = 0; r < NW; ++r) {
    const int row = (n0 + r % R < a.n ? n0 + r % R : a.n - 1) + (r >= R ? a.n : 0);
    rowi[r] = row;
    rows[r] = a.data + static_cast<int64_t>(row) * a.k;
    srow[r] = a.g.scales + static_cast<int64_t>(row / a.g.bn) * a.g.cols;
  }
  float acc[NW][NT] = {};
  for (int base = 0; base < a.k; base += kStep) {
    Word q[NW][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * kWarp + lane) * 16;
#pragma unroll
      for (int r = 0; r < NW; ++r)
        if (col < a.k)
          q[r][u] = load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(rows[r] + col));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * kWarp + lane) * 16;
      if (col >= a.k) break;
      float wv[NW][16], sc[NW];
#pragma unroll
      for (int r = 0; r < NW; ++r) {
#pragma unroll
        for (int j = 0; j < 4; ++j) fp8::e4m3x4_div256(q[r][u].v[j], wv[r] + 4 * j);
        sc[r] = srow[r][col >> a.g.bk_shift];
      }
      float gv[16];
      if constexpr (NORM) load_x16<T>(static_cast<const T*>(a.norm) + col, gv);
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        if (t >= a.ntok) break;
        float xv[16];
        load_x16<T>(x + t * a.ldx + col, xv);
        if constexpr (NORM) {
#pragma unroll
          for (int i = 0; i < 16; ++i) xv[i] = to_float(from_float<T>(xv[i] * inv_rms[t] * gv[i]));
        }
#pragma unroll
        for (int r = 0; r < NW; ++r) {
          float d = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) d += xv[i] * wv[r][i];
          acc[r][t] += d * sc[r];
        }
      }
    }
  }
  allow_dependents();
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (t >= a.ntok) break;
#pragma unroll
    for (int r = 0; r < NW; ++r) acc[r][t] = warp_sum(acc[r][t]) * 256.f * a.g.row_scale[rowi[r]];
  }
  if (lane != 0) return;
  T* out = static_cast<T*>(a.out);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = n0 + r;
    if (n >= a.n) break;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= a.ntok) break;
      T* o = out + t * a.ldo + n;
      if (MODE == kStore) {
        const float b = a.bias != nullptr ? to_float(static_cast<const T*>(a.bias)[n]) : 0.f;
        *o = from_float<T>(acc[r][t] + b);
      } else if (MODE == kAddResidual) {
        *o = from_float<T>(to_float(*o) + to_float(from_float<T>(acc[r][t])));
      } else {  // gate and up rounded where the unfused chain stores them
        const float g = to_float(from_float<T>(acc[r][t]));
        const float u = to_float(from_float<T>(acc[R + r][t]));
        *o = from_float<T>(g / (1.f + __expf(-g)) * u);
      }
    }
  }
}

// Which kernel one call runs: go(kernel, blocks) with the instantiation that the rows per warp,
// the tokens, the mode and the norm prologue select (the launch part below and the emulated
// test both launch through it).
template <typename T, int MODE, class Go>
void dispatch(const Args& a, int64_t rows, Go&& go) {
  with_rows_tokens(rows, a.ntok, [&](auto r, auto nt) {
    constexpr int R = decltype(r)::value, NT = decltype(nt)::value;
    const auto blocks = static_cast<unsigned>(ceil_div(a.n, kWarps * R));
    if (a.norm != nullptr) {
      go(fp8_gemv_kernel<T, R, NT, MODE, true>, blocks);
    } else {
      go(fp8_gemv_kernel<T, R, NT, MODE, false>, blocks);
    }
  });
}

}  // namespace fp8_kernel

// ---------------------------------------------------------------- launches and checks
#if !defined(FT_HOST_EMULATION)
namespace {

using fp8_kernel::Args;
using fp8_kernel::Fp8Grid;
using namespace quant_gemv;

/*! \brief log2(bk) for a power-of-two block width, 30 for a block spanning the row (one scale
 * column), -1 otherwise. */
int block_shift(int64_t bk, int64_t k) {
  if (bk >= k) return 30;
  for (int s = 0; s < 30; ++s)
    if ((int64_t{1} << s) == bk) return s;
  return -1;
}

// Checks every operand and launches epilogue `mode` (fp8_kernel::Mode).
void run(TensorView out, TensorView x, TensorView data, TensorView scales, TensorView row_scale,
         int64_t block_n, int64_t block_k, tvm::ffi::Optional<TensorView> bias,
         tvm::ffi::Optional<TensorView> norm, double eps, int64_t mode, int64_t rows, bool pdl) {
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
  TVM_FFI_ICHECK(mode == fp8_kernel::kStore || mode == fp8_kernel::kAddResidual ||
                 mode == fp8_kernel::kSwiGLU)
      << "mode must be 0 (store), 1 (residual add) or 2 (SwiGLU), got " << mode;
  const bool swiglu = mode == fp8_kernel::kSwiGLU;
  TVM_FFI_ICHECK(!swiglu || n % 2 == 0) << "a SwiGLU weight has 2*I rows, got " << n;
  const int64_t n_out = swiglu ? n / 2 : n;
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(rx.width == k && ro.width == n_out && rx.rows == ro.rows)
      << "x must be [T, " << k << "] and out [T, " << n_out << "]";
  TVM_FFI_ICHECK(!bias.has_value() || mode == fp8_kernel::kStore) << "a bias is for mode 0 only";
  auto check_vector = [&](const TensorView& v, int64_t size, const char* name) {
    check_gpu(v, name, dev);
    check_same_dtype(v, x, name, "x");
    TVM_FFI_ICHECK(v.ndim() == 1 && v.size(0) == size && v.IsContiguous() && aligned16(v))
        << name << " must be a contiguous, 16-byte aligned [" << size << "] tensor";
  };
  if (bias.has_value()) check_vector(bias.value(), n_out, "bias");
  if (norm.has_value()) check_vector(norm.value(), k, "norm_weight");
  TVM_FFI_ICHECK(rx.rows <= kMaxTokens) << "fp8_gemv takes at most " << kMaxTokens << " rows of x";
  TVM_FFI_ICHECK(aligned16(x) && rx.stride % 8 == 0) << "x rows must be 16-byte aligned";
  if (rx.rows == 0 || n == 0) return;
  const Fp8Grid g{data_of<float>(scales), data_of<float>(row_scale),
                  static_cast<int>(block_n < n ? block_n : n), shift,
                  static_cast<int>(scales.size(1))};
  const Args a{data_of<void>(out), data_of<void>(x), data_of<uint8_t>(data), g,
               bias.has_value() ? data_of<void>(bias.value()) : nullptr,
               norm.has_value() ? data_of<void>(norm.value()) : nullptr,
               static_cast<int>(rx.rows), static_cast<int>(n_out),
               static_cast<int>(k), rx.stride, ro.stride, static_cast<float>(eps)};
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  auto go = [&](auto kernel, unsigned blocks) {
    launch_maybe_pdl(kernel, dim3(blocks), dim3(kWarps * kWarp), stream, pdl, dev, a);
  };
  auto by_mode = [&](auto t) {
    using T = decltype(t);
    using namespace fp8_kernel;
    if (mode == kStore) dispatch<T, kStore>(a, rows, go);
    if (mode == kAddResidual) dispatch<T, kAddResidual>(a, rows, go);
    if (swiglu) dispatch<T, kSwiGLU>(a, rows, go);
  };
  if (ft == FloatType::kBF16) {
    by_mode(bf16());
  } else {
    by_mode(f16());
  }
  check_launch("fp8_gemv");
}

/*! \brief out[T, N] = x[T, K] @ W.T for T <= 8, W[n, c] = e4m3(data[n, c]) * scales[n / bn,
 * c / bk] * row_scale[n]; x, out bf16 or f16; bk a power of two (>= 16) or >= K. */
void fp8_gemv(TensorView out, TensorView x, TensorView data, TensorView scales,
              TensorView row_scale, int64_t block_n, int64_t block_k, int64_t rows) {
  run(out, x, data, scales, row_scale, block_n, block_k, tvm::ffi::Optional<TensorView>(),
      tvm::ffi::Optional<TensorView>(), 0.0, fp8_kernel::kStore, rows, false);
}

/*!
 * \brief fp8_gemv with the fused decode step's prologue and epilogues: xn = rms_norm(x) *
 * norm_weight when norm_weight is given (else x); mode 0: out = xn @ W.T (+ bias); 1: out (the
 * residual) += xn @ W.T, the product rounded first; 2: out = silu(g) * u for [g | u] = xn @
 * W.T, W [2I, K]. pdl: launch as a programmatic dependent where the device has it.
 */
void fp8_gemv_fused(TensorView out, TensorView x, TensorView data, TensorView scales,
                    TensorView row_scale, int64_t block_n, int64_t block_k,
                    tvm::ffi::Optional<TensorView> bias,
                    tvm::ffi::Optional<TensorView> norm_weight, double eps, int64_t mode,
                    int64_t rows, bool pdl) {
  run(out, x, data, scales, row_scale, block_n, block_k, bias, norm_weight, eps, mode, rows,
      pdl);
}

}  // namespace
#endif  // !FT_HOST_EMULATION
}  // namespace freetoken

#if !defined(FT_HOST_EMULATION)
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fp8_gemv, freetoken::fp8_gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fp8_gemv_fused, freetoken::fp8_gemv_fused);
#endif
