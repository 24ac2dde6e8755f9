// Routed experts over scaled low-precision weights (FP8 e4m3 with a float32 scale grid, NVFP4
// e2m1 with e4m3 scales per 16 columns), for decode batches: the same SwiGLU MLPs and weighted
// combine as moe_experts (kernels/cuda/moe.cu),
//
//   out[t] = sum_k topk_w[t, k] * down_s(silu(gate_s x_t) * up_s x_t),  s = expert_map[id],
//
// reading each routed expert's bytes in their own format (scale rule: scaled_decode.cuh).
//  1. gate/up: block (pair, 8 rows of I): warp j computes gate row j and up row I + j of the
//     pair's expert, 16 values per lane per step, and writes silu(gate) * up to act[pair, j].
//  2. down: block (token, 8 rows of H): warp h sums the token's K experts in a fixed order.
// No host sync, no allocation: capturable in a CUDA graph. A pair whose id or slot is out of
// range contributes nothing (raising would need a device sync). Prefill batches dequantize the
// experts and take moe_experts' grouped GEMMs instead (models/forward/scaled_moe.py).
#include "freetoken/cuda_common.cuh"
#include "freetoken/scaled_decode.cuh"

#include <initializer_list>

namespace freetoken {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxTopK = 16;

struct ExpertWeights {
  const uint8_t* data;     // [S, rows, row_bytes]
  const void* scales;      // [S, grid_rows, grid_cols]
  const float* row_scale;  // [S, rows]
  int rows, cols, bn, bk, grid_rows, grid_cols;

  // Row `row` of slot `s`: its bytes and the scale grid seen from that expert.
  __device__ __forceinline__ const uint8_t* row_bytes(int64_t s, int64_t row, int fmt) const {
    int64_t width = fmt == kScaledFp8 ? cols : cols / 2;
    return data + (s * rows + row) * width;
  }
  __device__ __forceinline__ ScaleGrid grid(int64_t s, int fmt) const {
    int64_t per = static_cast<int64_t>(grid_rows) * grid_cols;
    const char* base = static_cast<const char*>(scales) + s * per * (fmt == kScaledFp8 ? 4 : 1);
    return ScaleGrid{base, row_scale + s * rows, bn, bk, grid_cols};
  }
};

struct Args {
  const int* topk_ids;
  const float* topk_w;
  const int* expert_map;
  int tokens, top_k, experts, slots, hidden, inter;
};

__device__ __forceinline__ int slot_for(int e, const Args& a) {
  if (e < 0 || e >= a.experts) return -1;
  int s = a.expert_map[e];
  return s >= 0 && s < a.slots ? s : -1;
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kWarps * kWarp)
    scaled_gate_up_kernel(T* __restrict__ act, const T* __restrict__ x, ExpertWeights w13,
                          Args a) {
  int64_t pair = blockIdx.x;
  int lane = threadIdx.x % kWarp;
  int64_t j = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / kWarp;
  if (j >= a.inter) return;
  int s = slot_for(a.topk_ids[pair], a);
  if (s < 0) return;  // the down pass skips this pair too
  const T* xr = x + (pair / a.top_k) * a.hidden;
  ScaleGrid g = w13.grid(s, FMT);
  const uint8_t* gate = w13.row_bytes(s, j, FMT);
  const uint8_t* up = w13.row_bytes(s, a.inter + j, FMT);
  float gsum = 0.f, usum = 0.f;
  for (int col = lane * kScaledChunk; col < a.hidden; col += kWarp * kScaledChunk) {
    float wg[kScaledChunk], wu[kScaledChunk], xv[kScaledChunk];
    float sg = scaled_decode16<FMT>(gate, static_cast<int>(j), col, g, wg);
    float su = scaled_decode16<FMT>(up, static_cast<int>(a.inter + j), col, g, wu);
    load_x16<T>(xr + col, xv);
    float dg = 0.f, du = 0.f;
#pragma unroll
    for (int i = 0; i < kScaledChunk; ++i) {
      dg += xv[i] * wg[i];
      du += xv[i] * wu[i];
    }
    gsum += dg * sg;
    usum += du * su;
  }
  gsum = warp_sum(gsum) * g.row_scale[j];
  usum = warp_sum(usum) * g.row_scale[a.inter + j];
  if (lane == 0) act[pair * a.inter + j] = from_float<T>(gsum / (1.f + __expf(-gsum)) * usum);
}

template <typename T, int FMT>
__global__ void __launch_bounds__(kWarps * kWarp)
    scaled_down_kernel(T* __restrict__ out, const T* __restrict__ act, ExpertWeights w2,
                       Args a) {
  __shared__ int s_slot[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  int64_t t = blockIdx.x;
  if (threadIdx.x < a.top_k) {
    int64_t p = t * a.top_k + threadIdx.x;
    s_slot[threadIdx.x] = slot_for(a.topk_ids[p], a);
    s_w[threadIdx.x] = a.topk_w[p];
  }
  __syncthreads();
  int lane = threadIdx.x % kWarp;
  int64_t h = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / kWarp;
  if (h >= a.hidden) return;
  float acc = 0.f;
  for (int k = 0; k < a.top_k; ++k) {
    int s = s_slot[k];
    if (s < 0) continue;
    ScaleGrid g = w2.grid(s, FMT);
    const uint8_t* row = w2.row_bytes(s, h, FMT);
    const T* ar = act + (t * a.top_k + k) * a.inter;
    float sum = 0.f;
    for (int col = lane * kScaledChunk; col < a.inter; col += kWarp * kScaledChunk) {
      float wv[kScaledChunk], av[kScaledChunk];
      float sc = scaled_decode16<FMT>(row, static_cast<int>(h), col, g, wv);
      load_x16<T>(ar + col, av);
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < kScaledChunk; ++i) d += av[i] * wv[i];
      sum += d * sc;
    }
    acc += s_w[k] * g.row_scale[h] * warp_sum(sum);
  }
  if (lane == 0) out[t * a.hidden + h] = from_float<T>(acc);
}

// ---------------------------------------------------------------- host side

ExpertWeights check_experts(const TensorView& data, const TensorView& scales,
                            const TensorView& rows, int64_t fmt, int64_t bn, int64_t bk,
                            int64_t want_rows, int64_t want_cols, const char* name, int dev) {
  check_gpu(data, name, dev);
  check_gpu(scales, name, dev);
  check_gpu(rows, name, dev);
  check_dtype(data, kDLUInt, 8, name, "uint8 (the experts' bytes)");
  check_dtype(rows, kDLFloat, 32, name, "float32 row scales");
  check_ndim(data, 3, name);
  check_ndim(scales, 3, name);
  check_contiguous(data, name);
  check_contiguous(scales, name);
  check_contiguous(rows, name);
  TVM_FFI_ICHECK(aligned16(data)) << name << " must be 16-byte aligned";
  int64_t slots = data.size(0);
  int64_t cols = fmt == kScaledFp8 ? data.size(2) : 2 * data.size(2);
  TVM_FFI_ICHECK(data.size(1) == want_rows && cols == want_cols)
      << name << " must hold [S, " << want_rows << ", " << want_cols << "] weights";
  TVM_FFI_ICHECK(rows.numel() == slots * want_rows) << name << ": one row scale per row";
  if (fmt == kScaledFp8) {
    check_dtype(scales, kDLFloat, 32, name, "float32 scales for FP8");
    TVM_FFI_ICHECK(bn >= 1 && bk >= 1 && (bk % kScaledChunk == 0 || bk >= cols))
        << name << ": scale blocks must cover a multiple of 16 columns";
    TVM_FFI_ICHECK(scales.size(0) == slots && scales.size(1) == ceil_div(want_rows, bn) &&
                   scales.size(2) == ceil_div(cols, bk))
        << name << ": scales must be [S, " << ceil_div(want_rows, bn) << ", "
        << ceil_div(cols, bk) << "]";
  } else {
    check_dtype(scales, kDLUInt, 8, name, "uint8 e4m3 scales for NVFP4");
    TVM_FFI_ICHECK(scales.size(0) == slots && scales.size(1) == want_rows &&
                   scales.size(2) == cols / kScaledChunk)
        << name << ": NVFP4 scales must be [S, " << want_rows << ", " << cols / kScaledChunk
        << "]";
    bn = 1;
    bk = kScaledChunk;
  }
  return ExpertWeights{data_of<uint8_t>(data), data_of<char>(scales), data_of<float>(rows),
                       static_cast<int>(want_rows), static_cast<int>(cols),
                       static_cast<int>(bn), static_cast<int>(bk < cols ? bk : cols),
                       static_cast<int>(scales.size(1)), static_cast<int>(scales.size(2))};
}

void launch_experts(FloatType ft, int64_t fmt, TensorView out, TensorView x, TensorView act,
                    const ExpertWeights& g13, const ExpertWeights& g2, const Args& a,
                    cudaStream_t stream) {
  int64_t tokens = a.tokens, top_k = a.top_k;
  dim3 gu(static_cast<unsigned>(tokens * top_k), static_cast<unsigned>(ceil_div(a.inter, kWarps)));
  dim3 dn(static_cast<unsigned>(tokens), static_cast<unsigned>(ceil_div(a.hidden, kWarps)));
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (fmt == kScaledFp8) {
      scaled_gate_up_kernel<T, kScaledFp8><<<gu, kWarps * kWarp, 0, stream>>>(
          data_of<T>(act), data_of<T>(x), g13, a);
      scaled_down_kernel<T, kScaledFp8><<<dn, kWarps * kWarp, 0, stream>>>(
          data_of<T>(out), data_of<T>(act), g2, a);
    } else {
      scaled_gate_up_kernel<T, kScaledNvfp4><<<gu, kWarps * kWarp, 0, stream>>>(
          data_of<T>(act), data_of<T>(x), g13, a);
      scaled_down_kernel<T, kScaledNvfp4><<<dn, kWarps * kWarp, 0, stream>>>(
          data_of<T>(out), data_of<T>(act), g2, a);
    }
  });
  check_launch("moe_experts_scaled");
}

/*! \brief moe_experts for decode batches over scaled experts; act [>= T*K, I] in x's dtype. */
void moe_experts_scaled(TensorView out, TensorView x, TensorView w13, TensorView w13_scales,
                        TensorView w13_rows, TensorView w2, TensorView w2_scales,
                        TensorView w2_rows, int64_t fmt, int64_t bn13, int64_t bk13,
                        int64_t bn2, int64_t bk2, TensorView topk_ids, TensorView topk_weights,
                        TensorView expert_map, TensorView act) {
  int dev = x.device().device_id;
  TVM_FFI_ICHECK(fmt == kScaledFp8 || fmt == kScaledNvfp4) << "fmt must be 0 (FP8) or 1 (NVFP4)";
  for (const TensorView* t : {&out, &x, &topk_ids, &topk_weights, &expert_map, &act}) {
    check_gpu(*t, "moe_experts_scaled argument", dev);
    check_contiguous(*t, "moe_experts_scaled argument");
  }
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_dtype(act, x, "act", "x");
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_dtype(expert_map, kDLInt, 32, "expert_map", "int32");
  check_ndim(x, 2, "x");
  check_ndim(topk_ids, 2, "topk_ids");
  int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  int64_t inter = w2.size(2) * (fmt == kScaledFp8 ? 1 : 2);
  TVM_FFI_ICHECK(top_k <= kMaxTopK) << "top_k must be <= " << kMaxTopK;
  TVM_FFI_ICHECK(topk_ids.size(0) == tokens && topk_weights.numel() == tokens * top_k)
      << "topk_ids / topk_weights must be [T, K]";
  TVM_FFI_ICHECK(hidden % kScaledChunk == 0 && inter % kScaledChunk == 0)
      << "hidden (" << hidden << ") and expert width (" << inter << ") must be multiples of 16";
  TVM_FFI_ICHECK(act.numel() >= tokens * top_k * inter) << "act must hold [T*K, I] values";
  ExpertWeights g13 = check_experts(w13, w13_scales, w13_rows, fmt, bn13, bk13, 2 * inter,
                                    hidden, "w13", dev);
  ExpertWeights g2 = check_experts(w2, w2_scales, w2_rows, fmt, bn2, bk2, hidden, inter, "w2",
                                   dev);
  TVM_FFI_ICHECK(w2.size(0) == w13.size(0)) << "w13 and w2 must hold the same slots";
  TVM_FFI_ICHECK(aligned16(x) && aligned16(act)) << "x and act must be 16-byte aligned";
  if (tokens == 0) return;
  Args a{data_of<int>(topk_ids), data_of<float>(topk_weights), data_of<int>(expert_map),
         static_cast<int>(tokens), static_cast<int>(top_k),
         static_cast<int>(expert_map.numel()), static_cast<int>(w13.size(0)),
         static_cast<int>(hidden), static_cast<int>(inter)};
  DeviceGuard guard(dev);
  launch_experts(ft, fmt, out, x, act, g13, g2, a, stream_for(x));
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_scaled, freetoken::moe_experts_scaled);
