// Non-causal attention over variable-length segments (the vision encoder: each image's patches
// attend to all patches of that image only). Two kernels, chosen on the host by dtype:
//  * tensor cores (bf16/f16 on CUDA): a block takes 64 queries of one head within one segment
//    (4 warps of 16 rows); keys and values of the segment stream through shared memory in tiles
//    of 64 with cp.async, scores and P.V on mma.m16n8k16 with an online softmax. The head dim is
//    zero-padded to a multiple of 16 in shared memory (72 -> 80 for Qwen3.5's tower). P is
//    rounded to the input dtype for the second mma, as flash attention does.
//  * CUDA cores (float32, and every dtype on ROCm): a block takes 32 consecutive queries of one
//    head; 4 lanes share a query, each holding up to 32 of its head dims in registers. Keys and
//    values stream through shared memory in tiles of 32 rows (f32); a tile's scores are kept in
//    registers and folded into the running softmax once per tile. Queries of a block may
//    straddle a segment boundary: the block walks the union of their segments and each query
//    masks keys outside its own.
// Both take any head_dim that is a multiple of 8 up to 128.
#include <type_traits>

#include "freetoken/cuda_common.cuh"
#include "freetoken/mma_tiles.cuh"

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

#if !defined(__HIP_PLATFORM_AMD__)
// ---------------------------------------------------------------- tensor cores

constexpr int kTcRows = 64;     // queries per block: 4 warps x 16 rows
constexpr int kTcKeys = 64;     // keys per shared-memory tile
constexpr int kTcThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

// DP: the head dim padded to a multiple of 16 (the mma's k). A row pitch of DP + 8 elements
// (an odd number of 16-byte units) keeps ldmatrix reads free of bank conflicts.
template <int DP>
struct TcShape {
  static constexpr int kPitch = DP + 8;
  static constexpr int kSmemBytes = (kTcRows + 2 * kTcKeys) * kPitch * 2;
};

// Tiles of segment s are numbered from cu[s] / kTcRows + s (at most one partial tile a segment).
__device__ __forceinline__ int tile_segment(const int32_t* cu, int segments, int tile) {
  int lo = 0, hi = segments - 1;      // the last s whose first tile is <= tile
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (cu[mid] / kTcRows + mid <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// `rows` rows of a [tokens, *] matrix (row stride `stride`, this head's columns from `col0`) into
// a shared tile; rows past `valid` and columns past `dim` are zero-filled.
template <typename T, int DP>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int64_t first, int valid,
                                          int64_t stride, int64_t col0, int dim) {
  constexpr int kChunks = DP / 8, kPitch = TcShape<DP>::kPitch;
  for (int i = threadIdx.x; i < kTcKeys * kChunks; i += kTcThreads) {
    const int r = i / kChunks, c = i - r * kChunks;
    const bool ok = r < valid && c * 8 < dim;
    cp_async16(dst + r * kPitch + c * 8, ok ? src + (first + r) * stride + col0 + c * 8 : src,
               ok);
  }
}

template <typename T, int DP>
__global__ void __launch_bounds__(kTcThreads)
vision_attention_tc_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, int64_t os, int64_t qs, int64_t ks,
                           int64_t vs, const int32_t* __restrict__ cu, int segments, int dim,
                           float scale_log2) {
  static_assert(kTcRows == kTcKeys, "load_rows serves the query and the key tiles");
  constexpr int LD = TcShape<DP>::kPitch, BN = kTcKeys;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kTcRows * LD;
  T* sV = sK + BN * LD;
  const int seg = tile_segment(cu, segments, blockIdx.x);
  const int begin = cu[seg], end = cu[seg + 1];
  const int q0 = begin + (static_cast<int>(blockIdx.x) - (begin / kTcRows + seg)) * kTcRows;
  if (q0 >= end) return;              // the spare tile of a segment that ends on a boundary
  const int rows = min(kTcRows, end - q0);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const bool active = warp * 16 < rows;   // warps of padding rows share loads, skip the math

  load_rows<T, DP>(sQ, q, q0, rows, qs, col0, dim);
  cp_async_commit();
  float o[DP / 8][4] = {};
  float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;  // rows lane / 4 and lane / 4 + 8

  for (int n0 = begin; n0 < end; n0 += BN) {
    __syncthreads();                  // every warp is done with the previous K and V tiles
    load_rows<T, DP>(sK, k, n0, end - n0, ks, col0, dim);
    cp_async_commit();
    load_rows<T, DP>(sV, v, n0, end - n0, vs, col0, dim);
    cp_async_commit();
    cp_async_wait<1>();               // Q and K landed; V may still be in flight
    __syncthreads();
    float s[BN / 8][4] = {};
    if (active) {
      warp_scores<T, DP, BN, LD>(sQ, sK, warp * 16, s);   // S = Q K^T for the warp's 16 rows
      // mask the zero-filled keys past the segment; online softmax in log2 units
      float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = n0 + nt * 8 + tq * 2 + (e & 1) < end;
          s[nt][e] = ok ? s[nt][e] * scale_log2 : kNegInf;
        }
        mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
        mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
      }
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {   // a row lives in the 4 lanes of a quad
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
      }
      // every tile holds at least one key of the segment, so the maxima are finite
      const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);
      const float alpha0 = exp2f(m0 - new0), alpha1 = exp2f(m1 - new1);
      m0 = new0;
      m1 = new1;
      l0 *= alpha0;
      l1 *= alpha1;
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
        s[nt][0] = exp2f(s[nt][0] - new0);
        s[nt][1] = exp2f(s[nt][1] - new0);
        s[nt][2] = exp2f(s[nt][2] - new1);
        s[nt][3] = exp2f(s[nt][3] - new1);
        l0 += s[nt][0] + s[nt][1];
        l1 += s[nt][2] + s[nt][3];
      }
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        o[dt][0] *= alpha0;
        o[dt][1] *= alpha0;
        o[dt][2] *= alpha1;
        o[dt][3] *= alpha1;
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    if (active) {
      warp_values<T, DP, BN, LD>(sV, s, o);                // O += P V
    }
  }
  cp_async_wait<0>();
  if (!active) return;
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + lane / 4 + half * 8;
    if (r >= rows) continue;
    const float inv = 1.f / (half ? l1 : l0);
    T* orow = out + (q0 + r) * os + col0 + tq * 2;
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt) {
      if (dt * 8 < dim) {
        *reinterpret_cast<uint32_t*>(orow + dt * 8) =
            pack2<T>(o[dt][half * 2] * inv, o[dt][half * 2 + 1] * inv);
      }
    }
  }
}

template <typename T, int DP>
void launch_tc(T* out, const T* q, const T* k, const T* v, int64_t os, int64_t qs, int64_t ks,
               int64_t vs, const int32_t* cu, int segments, int64_t tokens, int64_t heads,
               int dim, float scale, cudaStream_t stream) {
  constexpr int kBytes = TcShape<DP>::kSmemBytes;
  // above 48 KiB of dynamic shared memory (DP 128) needs an opt-in, once per device
  static bool opted_in[64] = {};
  int device = 0;
  FT_CUDA_CHECK(cudaGetDevice(&device));
  if (kBytes > 48 * 1024 && (device < 0 || device >= 64 || !opted_in[device])) {
    FT_CUDA_CHECK(cudaFuncSetAttribute(vision_attention_tc_kernel<T, DP>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    if (device >= 0 && device < 64) opted_in[device] = true;
  }
  dim3 grid(static_cast<unsigned>(tokens / kTcRows + segments), static_cast<unsigned>(heads));
  vision_attention_tc_kernel<T, DP><<<grid, kTcThreads, kBytes, stream>>>(
      out, q, k, v, os, qs, ks, vs, cu, segments, dim, scale * kLog2e);
}

// The head dim rounded up to a multiple of 16 picks the instantiation.
template <typename T>
void vision_attention_tc(T* out, const T* q, const T* k, const T* v, int64_t os, int64_t qs,
                         int64_t ks, int64_t vs, const int32_t* cu, int segments,
                         int64_t tokens, int64_t heads, int dim, float scale,
                         cudaStream_t stream) {
  switch ((dim + 15) / 16) {
#define FT_VISION_TC(n)                                                                     \
  case n:                                                                                   \
    launch_tc<T, 16 * n>(out, q, k, v, os, qs, ks, vs, cu, segments, tokens, heads, dim, scale, \
                         stream);                                                           \
    break;
    FT_VISION_TC(1) FT_VISION_TC(2) FT_VISION_TC(3) FT_VISION_TC(4)
    FT_VISION_TC(5) FT_VISION_TC(6) FT_VISION_TC(7) FT_VISION_TC(8)
#undef FT_VISION_TC
    default:
      TVM_FFI_ICHECK(false) << "internal: head_dim " << dim << " has no tensor-core instance";
  }
}
#endif  // !__HIP_PLATFORM_AMD__

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
  const int32_t* cu = data_of<int32_t>(cu_seqlens);
  cudaStream_t stream = stream_for(q);
#if !defined(__HIP_PLATFORM_AMD__)
  if (ft != FloatType::kF32) {
    FT_CUDA_DISPATCH_FLOAT(ft, T, {
      if constexpr (!std::is_same_v<T, float>) {
        vision_attention_tc<T>(data_of<T>(out), data_of<T>(q), data_of<T>(k), data_of<T>(v),
                               orow.stride, qr.stride, kr.stride, vr.stride, cu,
                               static_cast<int>(segments), tokens, num_heads,
                               static_cast<int>(dim), static_cast<float>(scale), stream);
      }
    });
    check_launch("vision_attention (tensor cores)");
    return;
  }
#endif
  dim3 grid(static_cast<unsigned>(ceil_div(tokens, kQueries)), static_cast<unsigned>(num_heads));
  const int chunks = static_cast<int>(ceil_div(dim, kLanes * 8));
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    auto kernel = chunks == 1   ? vision_attention_kernel<T, 1>
                  : chunks == 2 ? vision_attention_kernel<T, 2>
                  : chunks == 3 ? vision_attention_kernel<T, 3>
                                : vision_attention_kernel<T, kMaxChunks>;
    kernel<<<grid, kThreads, 0, stream>>>(
        data_of<T>(out), data_of<T>(q), data_of<T>(k), data_of<T>(v), orow.stride, qr.stride,
        kr.stride, vr.stride, cu, static_cast<int>(segments), tokens, static_cast<int>(dim),
        static_cast<float>(scale));
  });
  check_launch("vision_attention");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vision_attention, freetoken::vision_attention);
