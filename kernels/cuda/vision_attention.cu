// Non-causal attention over variable-length segments (the vision encoder: each image's patches
// attend to all patches of that image only). A block takes 32 consecutive queries of one head;
// 4 lanes share a query, each holding up to 32 of its head dims in registers, so head_dim may be
// any multiple of 8 up to 128 (72 for Qwen3.5's tower). Keys and values stream through shared
// memory in tiles of 32 rows (f32); a tile's scores are kept in registers and folded into the
// running softmax once per tile. Queries of a block may straddle a segment boundary: the block
// walks the union of their segments and each query masks keys outside its own.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

constexpr int kQueries = 32;          // per block
constexpr int kLanes = 4;             // threads per query
constexpr int kKeys = 32;             // keys per shared-memory tile
constexpr int kMaxDim = 128;
constexpr int kMaxChunks = kMaxDim / (kLanes * 8);   // 8-wide column chunks per lane
constexpr int kThreads = kQueries * kLanes;
#define kNegInf (-__builtin_huge_valf())

__device__ __forceinline__ int segment_of(const int32_t* cu, int segments, int64_t t) {
  int lo = 0, hi = segments - 1;      // the last s with cu[s] <= t
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Column of a lane's value (chunk c, element e): chunks of 8 interleave over the 4 lanes.
__device__ __forceinline__ int column(int lane, int c, int e) { return (c * kLanes + lane) * 8 + e; }

// kChunks = ceil(head_dim / 32): a lane walks only the chunks a head can fill (3 for 72).
template <typename T, int kChunks>
__global__ void __launch_bounds__(kThreads)
vision_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                        const T* __restrict__ v, int64_t os, int64_t qs, int64_t ks,
                        int64_t vs, const int32_t* __restrict__ cu, int segments,
                        int64_t tokens, int dim, float scale) {
  __shared__ float k_tile[kKeys][kMaxDim + 4];
  __shared__ float v_tile[kKeys][kMaxDim + 4];
  const int head = blockIdx.y, lane = threadIdx.x % kLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kQueries;
  const int64_t last = min(first + kQueries, tokens) - 1;
  const int64_t i = first + threadIdx.x / kLanes;
  const int64_t key_begin = cu[segment_of(cu, segments, first)];
  const int64_t key_end = cu[segment_of(cu, segments, last) + 1];
  int64_t my_begin = 0, my_end = 0;
  if (i < tokens) {
    int s = segment_of(cu, segments, i);
    my_begin = cu[s];
    my_end = cu[s + 1];
  }
  float qf[kChunks][8], acc[kChunks][8];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int col = column(lane, c, e);
      qf[c][e] = (i < tokens && col < dim) ? to_float(q[i * qs + head * dim + col]) * scale : 0.f;
      acc[c][e] = 0.f;
    }
  }
  // Columns past head_dim are read (times a zero q or into an unused acc) but never loaded:
  // zero them once, as stale shared memory may hold NaN bit patterns.
  for (int idx = threadIdx.x; idx < kKeys * kMaxDim; idx += kThreads) {
    const int r = idx / kMaxDim, col = idx - r * kMaxDim;
    if (col >= dim) k_tile[r][col] = v_tile[r][col] = 0.f;
  }
  float run_max = kNegInf, run_sum = 0.f;
  for (int64_t j0 = key_begin; j0 < key_end; j0 += kKeys) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kKeys * dim; idx += kThreads) {
      const int r = idx / dim, col = idx - r * dim;
      const int64_t j = j0 + r;
      const bool ok = j < key_end;
      k_tile[r][col] = ok ? to_float(k[j * ks + head * dim + col]) : 0.f;
      v_tile[r][col] = ok ? to_float(v[j * vs + head * dim + col]) : 0.f;
    }
    __syncthreads();
    float scores[kKeys];
    float tile_max = kNegInf;
#pragma unroll
    for (int r = 0; r < kKeys; ++r) {
      float part = 0.f;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int e = 0; e < 8; ++e) part += qf[c][e] * k_tile[r][column(lane, c, e)];
      }
      part += __shfl_xor_sync(0xffffffffu, part, 1);
      part += __shfl_xor_sync(0xffffffffu, part, 2);
      const int64_t j = j0 + r;
      scores[r] = (j >= my_begin && j < my_end) ? part : kNegInf;
      tile_max = fmaxf(tile_max, scores[r]);
    }
    if (tile_max == kNegInf) continue;   // no key of this tile is in this query's image
    const float new_max = fmaxf(run_max, tile_max);
    const float fix = __expf(run_max - new_max);   // 0 on the first tile (run_max = -inf)
    run_sum *= fix;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[c][e] *= fix;
    }
#pragma unroll
    for (int r = 0; r < kKeys; ++r) {
      const float p = __expf(scores[r] - new_max);
      run_sum += p;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[c][e] += p * v_tile[r][column(lane, c, e)];
      }
    }
    run_max = new_max;
  }
  if (i >= tokens) return;
  const float inv = run_sum > 0.f ? 1.f / run_sum : 0.f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int col = column(lane, c, e);
      if (col < dim) out[i * os + head * dim + col] = from_float<T>(acc[c][e] * inv);
    }
  }
}

/*!
 * \brief out[t, h*D:(h+1)*D] = softmax(q_t . k_s * scale) v_s over the s of t's segment.
 * q, k, v, out: [T, H*D] (rows may be strided: column slices of a fused qkv), D a multiple of 8
 * up to 128; cu_seqlens int32 [S+1] on the GPU, from 0 to T.
 */
void vision_attention(TensorView out, TensorView q, TensorView k, TensorView v,
                      TensorView cu_seqlens, int64_t num_heads, double scale) {
  const int dev = q.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(q, "q", dev);
  check_gpu(k, "k", dev);
  check_gpu(v, "v", dev);
  check_gpu(cu_seqlens, "cu_seqlens", dev);
  FloatType ft = float_type(q, "q");
  check_same_dtype(k, q, "k", "q");
  check_same_dtype(v, q, "v", "q");
  check_same_dtype(out, q, "out", "q");
  check_contiguous(cu_seqlens, "cu_seqlens");
  check_dtype(cu_seqlens, kDLInt, 32, "cu_seqlens", "int32");
  RowView qr = row_view(q, 1, "q"), kr = row_view(k, 1, "k"), vr = row_view(v, 1, "v"),
          orow = row_view(out, 1, "out");
  const int64_t tokens = qr.rows, width = qr.width;
  TVM_FFI_ICHECK(num_heads > 0 && width % num_heads == 0)
      << "q's width " << width << " is not a multiple of num_heads " << num_heads;
  const int64_t dim = width / num_heads;
  TVM_FFI_ICHECK(dim % 8 == 0 && dim <= kMaxDim)
      << "head_dim must be a multiple of 8 up to " << kMaxDim << ", got " << dim;
  TVM_FFI_ICHECK(kr.rows == tokens && vr.rows == tokens && orow.rows == tokens &&
                 kr.width == width && vr.width == width && orow.width == width)
      << "q, k, v and out must all be [" << tokens << ", " << width << "]";
  const int64_t segments = cu_seqlens.size(0) - 1;
  TVM_FFI_ICHECK(segments >= 1) << "cu_seqlens needs at least 2 entries";
  if (tokens == 0) return;
  DeviceGuard guard(dev);
  dim3 grid(static_cast<unsigned>(ceil_div(tokens, kQueries)), static_cast<unsigned>(num_heads));
  const int chunks = static_cast<int>(ceil_div(dim, kLanes * 8));
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    auto kernel = chunks == 1   ? vision_attention_kernel<T, 1>
                  : chunks == 2 ? vision_attention_kernel<T, 2>
                  : chunks == 3 ? vision_attention_kernel<T, 3>
                                : vision_attention_kernel<T, kMaxChunks>;
    kernel<<<grid, kThreads, 0, stream_for(q)>>>(
        data_of<T>(out), data_of<T>(q), data_of<T>(k), data_of<T>(v), orow.stride, qr.stride,
        kr.stride, vr.stride, data_of<int32_t>(cu_seqlens), static_cast<int>(segments),
        tokens, static_cast<int>(dim), static_cast<float>(scale));
  });
  check_launch("vision_attention");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vision_attention, freetoken::vision_attention);
