// GGUF-quantized projections on the GPU: the weight stays in its blocks in VRAM and is decoded
// in registers or shared memory on every call (freetoken/gguf_blocks.h, shared with a host
// test). Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; activations bf16; output bf16
// or f32.
//
// gguf_matmul dispatches on the activation rows M:
//  - M <= 8 (decode): GEMV. Each warp owns kRows weight rows and streams them once: a chunk of
//    whole blocks per row goes global -> shared memory in 16-byte loads (2-byte loads when rows
//    are not 16-byte multiples), then every lane takes 32-weight units and dots them with each
//    activation row (gguf::dot32: scales applied once per unit), so one x load serves kRows
//    weight rows.
//  - M > 8 (prefill, freetoken/gguf_tile.cuh): a 64 x 64 output tile per block; each 32-wide
//    k-slice of the weight is decoded into shared memory as bf16 and multiplied with wmma
//    16x16x16 bf16 tensor cores (f32 accumulation). HIP builds use a CUDA-core FMA tile instead
//    (no wmma there).
// gguf_dequantize_rows gathers whole rows (the quantized embedding lookup); gguf_dequantize
// writes a whole weight as bf16 (prefill's float GEMMs read it from a scratch buffer,
// models/forward/dequant.py).
// No allocation and no host sync: all are capturable in a CUDA graph.
#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"
#include "freetoken/gguf_stage.cuh"
#include "freetoken/gguf_tile.cuh"

namespace freetoken {
namespace {

using gguf::Block;
using gguf::decode8;
using gguf_tile::gemm_kernel;
using gguf_tile::kThreads;
using gguf_tile::kTile;
using gguf_tile::store_out;

constexpr int kGemvMaxM = 8, kGemvWarps = 4, kRows = 2;

using gguf_stage::warp_sync;

// Blocks staged per row and step: whole blocks, a multiple of 16 bytes (576..1680), and 32 or
// 64 units of 32 weights, so every lane has work.
template <int QT>
constexpr int chunk_blocks() {
  return QT == gguf::kQ6_K ? 8 : Block<QT>::kWeights == 32 ? 32 : 4;
}

__device__ __forceinline__ void load8(const bf16* p, float* f) {
  Vec<bf16, 8> v = load_vec<bf16, 8>(p);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = to_float(v.v[e]);
}

// kM: activation rows the kernel is built for (1: the batch-1 decode, with the fewest
// registers and so the most warps in flight; 8: up to 8 rows, m_rows at run time).
template <int QT, bool kVec16, int kM>
__global__ void __launch_bounds__(kGemvWarps * kWarp)
    gemv_kernel(void* out, bool out_f32, const bf16* __restrict__ x,
                const uint8_t* __restrict__ w, int m_rows, int64_t n, int64_t k,
                int64_t row_bytes, int64_t ldx, int64_t ldo) {
  using B = Block<QT>;
  constexpr int kCB = chunk_blocks<QT>(), kChunk = kCB * B::kBytes, kUnits = B::kWeights / 32;
  __shared__ __attribute__((aligned(16))) uint8_t smem[kGemvWarps][kRows][kChunk];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * kRows;
  if (n0 >= n) return;  // whole warps leave: the kernel only synchronises within a warp
  const int64_t nblocks = k / B::kWeights;
  float acc[kRows][kM];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int m = 0; m < kM; ++m) acc[r][m] = 0.f;
  for (int64_t b0 = 0; b0 < nblocks; b0 += kCB) {
    const int nb = static_cast<int>(nblocks - b0 < kCB ? nblocks - b0 : kCB);
    const int bytes = nb * B::kBytes;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (n0 + r >= n) break;
      const uint8_t* src = w + (n0 + r) * row_bytes + b0 * B::kBytes;
      if constexpr (kVec16) {
        using V = Vec<uint32_t, 4>;
        for (int i = lane; i < bytes / 16; i += kWarp)
          reinterpret_cast<V*>(smem[warp][r])[i] = reinterpret_cast<const V*>(src)[i];
      } else {
        for (int i = lane; i < bytes / 2; i += kWarp)
          reinterpret_cast<uint16_t*>(smem[warp][r])[i] =
              reinterpret_cast<const uint16_t*>(src)[i];
      }
    }
    warp_sync();
    // one 32-weight unit per lane and step: its x is loaded and summed once per row of x,
    // then dotted with every weight row of the warp
    for (int gi = lane; gi < nb * kUnits; gi += kWarp) {
      const int blk = gi / kUnits, u = gi % kUnits;
      const int64_t col = (b0 + blk) * B::kWeights + u * 32;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        if (m >= m_rows) break;
        float xv[32];
#pragma unroll
        for (int i = 0; i < 4; ++i) load8(x + m * ldx + col + 8 * i, xv + 8 * i);
        float xlo = 0.f, xhi = 0.f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          xlo += xv[i];
          xhi += xv[16 + i];
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          acc[r][m] += gguf::dot32<QT>(smem[warp][r] + blk * B::kBytes, u, xv, xlo, xhi);
      }
    }
    warp_sync();
  }
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    if (m >= m_rows) break;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float v = warp_sum(acc[r][m]);
      if (lane == 0 && n0 + r < n) store_out(out, out_f32, m * ldo + n0 + r, v);
    }
  }
}

template <int QT>
__global__ void rows_kernel(void* out, bool out_f32, const int64_t* __restrict__ ids,
                            const uint8_t* __restrict__ w, int64_t vocab, int64_t k,
                            int64_t row_bytes, int64_t ldo) {
  using B = Block<QT>;
  constexpr int kGroups = B::kWeights / 8;
  const int64_t t = blockIdx.x, id = ids[t];
  const bool valid = id >= 0 && id < vocab;  // else a zero row: raising would need a sync
  const uint8_t* row = w + (valid ? id : 0) * row_bytes;
  for (int64_t gi = threadIdx.x; gi < k / 8; gi += blockDim.x) {
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (valid) decode8<QT>(row + (gi / kGroups) * B::kBytes, static_cast<int>(gi % kGroups), f);
#pragma unroll
    for (int e = 0; e < 8; ++e) store_out(out, out_f32, t * ldo + gi * 8 + e, f[e]);
  }
}

// out[r, 8g .. 8g + 8) = the weights of group g of row r, one 16-byte store per group; the
// threads of a warp take consecutive groups of a row, so the blocks they read lie together.
template <int QT>
__global__ void dequantize_kernel(bf16* __restrict__ out, const uint8_t* __restrict__ w,
                                  int64_t n, int64_t k, int64_t row_bytes) {
  using B = Block<QT>;
  constexpr int kGroups = B::kWeights / 8;
  const int64_t per_row = k / 8, total = n * per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t r = i / per_row, g = i - r * per_row;
    float f[8];
    decode8<QT>(w + r * row_bytes + (g / kGroups) * B::kBytes, static_cast<int>(g % kGroups), f);
    Vec<bf16, 8> v;
#pragma unroll
    for (int e = 0; e < 8; ++e) v.v[e] = from_float<bf16>(f[e]);
    store_vec<bf16, 8>(out + r * k + g * 8, v);
  }
}

#define FT_GGUF_DISPATCH(qtype, QT, ...)                                                     \
  switch (qtype) {                                                                          \
    case gguf::kQ4_0: { constexpr int QT = gguf::kQ4_0; __VA_ARGS__; break; }              \
    case gguf::kQ4_1: { constexpr int QT = gguf::kQ4_1; __VA_ARGS__; break; }              \
    case gguf::kQ5_0: { constexpr int QT = gguf::kQ5_0; __VA_ARGS__; break; }              \
    case gguf::kQ5_1: { constexpr int QT = gguf::kQ5_1; __VA_ARGS__; break; }              \
    case gguf::kQ8_0: { constexpr int QT = gguf::kQ8_0; __VA_ARGS__; break; }              \
    case gguf::kQ4_K: { constexpr int QT = gguf::kQ4_K; __VA_ARGS__; break; }              \
    case gguf::kQ5_K: { constexpr int QT = gguf::kQ5_K; __VA_ARGS__; break; }              \
    case gguf::kQ6_K: { constexpr int QT = gguf::kQ6_K; __VA_ARGS__; break; }              \
    default: TVM_FFI_ICHECK(false) << "unsupported GGUF type " << qtype;                   \
  }

/*! \brief Checks qweight [rows, row_bytes] (uint8, contiguous) against `k` weights per row. */
void check_qweight(const TensorView& qweight, int64_t qtype, int64_t k, int dev) {
  check_gpu(qweight, "qweight", dev);
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_ndim(qweight, 2, "qweight");
  check_contiguous(qweight, "qweight");
  int weights = 0, bytes = 0;
  gguf::block_shape(static_cast<int>(qtype), &weights, &bytes);
  TVM_FFI_ICHECK(weights > 0) << "qtype " << qtype
                              << " is not a GGUF type the GPU reads (Q4_0 2, Q4_1 3, Q5_0 6, "
                                 "Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)";
  TVM_FFI_ICHECK(gguf::row_holds(static_cast<int>(qtype), k, qweight.size(1)))
      << "qweight rows must hold " << k << " weights: " << k / weights * bytes << " bytes of "
      << weights << "-weight blocks (k a multiple of " << weights << "), got "
      << qweight.size(1) << " bytes";
}

bool out_is_f32(const TensorView& out) {
  if (has_dtype(out, kDLFloat, 32)) return true;
  TVM_FFI_ICHECK(has_dtype(out, kDLBfloat, 16))
      << "out must be float32 or bfloat16, got " << dtype_name(out.dtype());
  return false;
}

/*! \brief out[M, N] = x[M, K] @ dequant(qweight).T; x bf16 with contiguous rows (16-byte
 * aligned), qweight uint8 [N, row_bytes] of GGUF blocks of type qtype, out f32 or bf16 with
 * contiguous rows (a column slice of a wider buffer is fine). */
void gguf_matmul(TensorView out, TensorView x, TensorView qweight, int64_t qtype) {
  int dev = qweight.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(x, "x", dev);
  check_dtype(x, kDLBfloat, 16, "x", "bfloat16");
  check_ndim(x, 2, "x");
  check_ndim(out, 2, "out");
  RowView rx = row_view(x, 1, "x"), ro = row_view(out, 1, "out");
  check_qweight(qweight, qtype, rx.width, dev);
  const int64_t n = qweight.size(0);
  TVM_FFI_ICHECK(ro.rows == rx.rows && ro.width == n)
      << "out must be [" << rx.rows << ", " << n << "] (x rows, qweight rows)";
  TVM_FFI_ICHECK(rx.stride % 8 == 0 && aligned16(x)) << "x rows must start 16-byte aligned";
  const bool f32 = out_is_f32(out);
  if (rx.rows == 0 || n == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(qweight);
  const int64_t rb = qweight.size(1);
  void* o = data_of<char>(out);
  const bf16* xp = data_of<bf16>(x);
  const uint8_t* wp = data_of<uint8_t>(qweight);
  if (rx.rows <= kGemvMaxM) {
    const bool vec16 = rb % 16 == 0 && aligned16(qweight);
    dim3 grid(static_cast<unsigned>(ceil_div(n, kGemvWarps * kRows)));
    const int m = static_cast<int>(rx.rows);
    auto launch = [&](auto kernel) {
      kernel<<<grid, kGemvWarps * kWarp, 0, stream>>>(o, f32, xp, wp, m, n, rx.width, rb,
                                                      rx.stride, ro.stride);
    };
    FT_GGUF_DISPATCH(qtype, QT, {
      if (m == 1) {
        launch(vec16 ? gemv_kernel<QT, true, 1> : gemv_kernel<QT, false, 1>);
      } else {
        launch(vec16 ? gemv_kernel<QT, true, kGemvMaxM> : gemv_kernel<QT, false, kGemvMaxM>);
      }
    });
    check_launch("gguf_matmul (gemv)");
    return;
  }
  TVM_FFI_ICHECK(ceil_div(rx.rows, kTile) < 65536) << "gguf_matmul: too many rows of x";
  dim3 grid(static_cast<unsigned>(ceil_div(n, kTile)), static_cast<unsigned>(ceil_div(rx.rows, kTile)));
  FT_GGUF_DISPATCH(qtype, QT, {
    gemm_kernel<QT><<<grid, kThreads, 0, stream>>>(o, f32, xp, wp, rx.rows, n, rx.width, rb,
                                                   rx.stride, ro.stride);
  });
  check_launch("gguf_matmul (gemm)");
}

/*! \brief out[T, K] = dequant(qweight[ids]) (f32 or bf16); ids int64 [T]; an id outside the
 * table writes a zero row (raising would need a device sync). */
void gguf_dequantize_rows(TensorView out, TensorView ids, TensorView qweight, int64_t qtype) {
  int dev = qweight.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(ids, "ids", dev);
  check_dtype(ids, kDLInt, 64, "ids", "int64");
  TVM_FFI_ICHECK(ids.ndim() == 1 && ids.IsContiguous()) << "ids must be a contiguous 1-D tensor";
  check_ndim(out, 2, "out");
  RowView ro = row_view(out, 1, "out");
  check_qweight(qweight, qtype, ro.width, dev);
  TVM_FFI_ICHECK(ro.rows == ids.size(0)) << "out must have len(ids) = " << ids.size(0) << " rows";
  const bool f32 = out_is_f32(out);
  if (ro.rows == 0 || ro.width == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(qweight);
  FT_GGUF_DISPATCH(qtype, QT, {
    rows_kernel<QT><<<static_cast<unsigned>(ro.rows), 128, 0, stream>>>(
        data_of<char>(out), f32, data_of<int64_t>(ids), data_of<uint8_t>(qweight),
        qweight.size(0), ro.width, qweight.size(1), ro.stride);
  });
  check_launch("gguf_dequantize_rows");
}

/*! \brief out[N, K] (bf16, contiguous, 16-byte aligned) = dequant(qweight), qweight uint8
 * [N, row_bytes] of GGUF blocks of type qtype (rows padded to 16 bytes or not). */
void gguf_dequantize(TensorView out, TensorView qweight, int64_t qtype) {
  int dev = qweight.device().device_id;
  check_gpu(out, "out", dev);
  check_dtype(out, kDLBfloat, 16, "out", "bfloat16");
  check_ndim(out, 2, "out");
  check_contiguous(out, "out");
  TVM_FFI_ICHECK(aligned16(out)) << "out must start on a 16-byte boundary";
  check_qweight(qweight, qtype, out.size(1), dev);
  TVM_FFI_ICHECK(out.size(0) == qweight.size(0))
      << "out must have qweight's " << qweight.size(0) << " rows, got " << out.size(0);
  const int64_t n = out.size(0), k = out.size(1);
  if (n == 0 || k == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(qweight);
  const int64_t blocks = ceil_div(n * (k / 8), 256);
  const unsigned grid = static_cast<unsigned>(blocks < 8192 ? blocks : 8192);
  FT_GGUF_DISPATCH(qtype, QT, {
    dequantize_kernel<QT><<<grid, 256, 0, stream>>>(data_of<bf16>(out),
                                                    data_of<uint8_t>(qweight), n, k,
                                                    qweight.size(1));
  });
  check_launch("gguf_dequantize");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gguf_matmul, freetoken::gguf_matmul);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gguf_dequantize, freetoken::gguf_dequantize);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gguf_dequantize_rows, freetoken::gguf_dequantize_rows);
