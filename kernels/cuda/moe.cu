// Mixture-of-experts on the GPU: softmax top-k routing, and the routed experts' SwiGLU MLPs with
// the weighted combine (out[t] = sum_k w[t,k] * down_s(silu(gate_s x_t) * up_s x_t)).
//
// moe_experts runs a fixed launch sequence chosen on the host from (T, K, E) alone, so a CUDA
// graph replays it and no device->host sync is ever needed:
//  1. align (one block): counts the (token, k) pairs per expert, scans the counts, writes a
//     tile table (expert, first sorted pair, rows) with M rows per tile, and scatters pair ids
//     into per-expert segments. Unused tile entries get expert -1 and their blocks exit.
//  2. decode (few pairs, GEMV): gate/up per tile of <= 8 pairs streams each expert row once
//     with 16-byte loads, SwiGLU in registers; the down projection runs per token and sums its
//     K experts in a fixed order, writing out directly.
//  3. prefill (many pairs, tiles of 64 pairs): gate/up as a grouped GEMM with the SwiGLU in the
//     epilogue; down as a grouped GEMM into f32 rows per pair, then a per-token sum over K. The
//     workspace is sized without H (the shared contract), so the down pass runs in column
//     chunks of y_cols(I) over H. bf16/f16 use tensor cores (wmma 16x16x16, f32 accumulate);
//     f32 and the HIP build take a CUDA-core FMA tile with the same staging.
// Results are deterministic: a pair's row never depends on which other pairs share its tile.
//
// The tile GEMM core both prefill kernels share lives in freetoken/moe_tile.cuh; the workspace
// plan and the alignment pass in freetoken/moe_align.cuh (shared with moe_gguf.cu).
// NOTE: over 400 lines because the routing, both expert paths and their host
// dispatch share one workspace plan and argument block, which must stay in one translation unit.
#include "freetoken/cuda_common.cuh"
#include "freetoken/moe_align.cuh"
#include "freetoken/moe_tile.cuh"

namespace freetoken {
namespace {

using moe_tile::kTileThreads;
using moe_tile::kTM;
using moe_tile::SmemBuf;
using moe_tile::TileLayout;
using moe_tile::tile_gemm;

using moe_align::kGemvRows;
using moe_align::kMaxExperts;
using moe_align::kMaxTopK;
using moe_align::make_plan;
using moe_align::Plan;
using moe_align::silu_mul;
using moe_align::slot_of;
using moe_align::TileTable;
static_assert(moe_align::kTileRows == kTM, "the plan's prefill tiles are the GEMM tile's rows");

constexpr int kRouteMaxExperts = 16 * kWarp;  // 16 logits per lane in registers
constexpr int kGemvWarps = 8;
constexpr float kNegInf = -__builtin_huge_valf();

// ---------------------------------------------------------------- small device helpers

template <typename T, int N>
__device__ __forceinline__ float dot_vec(const Vec<T, N>& a, const Vec<T, N>& b) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < N; ++e) s += to_float(a.v[e]) * to_float(b.v[e]);
  return s;
}

// ---------------------------------------------------------------- routing

// One warp per token: softmax over E in f32, then K rounds of a warp argmax (ties: lower id).
template <typename L>
__global__ void __launch_bounds__(256)
topk_softmax_kernel(float* __restrict__ weights, int* __restrict__ ids,
                    const L* __restrict__ logits, int64_t row_stride, int tokens, int experts,
                    int top_k, bool renormalize) {
  int lane = threadIdx.x % kWarp;
  int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  if (t >= tokens) return;
  const L* row = logits + t * row_stride;
  float v[kRouteMaxExperts / kWarp];
  float m = kNegInf;
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
    int e = lane + j * kWarp;
    v[j] = e < experts ? to_float(row[e]) : kNegInf;
    m = v[j] > m ? v[j] : m;
  }
  m = warp_max(m);
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
    v[j] = lane + j * kWarp < experts ? __expf(v[j] - m) : 0.f;
    sum += v[j];
  }
  float inv = 1.f / warp_sum(sum);
#pragma unroll
  for (int j = 0; j < kRouteMaxExperts / kWarp; ++j)
    v[j] = lane + j * kWarp < experts ? v[j] * inv : -1.f;  // -1: never selected
  float my_w = 0.f, picked = 0.f;
  int my_id = 0;
  for (int k = 0; k < top_k; ++k) {
    float best = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < kRouteMaxExperts / kWarp; ++j) {
      if (v[j] > best) {  // strict: the lower id wins a tie within the lane
        best = v[j];
        bi = lane + j * kWarp;
      }
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off >>= 1) {
      float ob = __shfl_xor_sync(0xffffffffu, best, off);
      int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (ob > best || (ob == best && oi < bi)) {
        best = ob;
        bi = oi;
      }
    }
    if (lane == k) {
      my_w = best;
      my_id = bi;
    }
    picked += best;
#pragma unroll
    for (int j = 0; j < kRouteMaxExperts / kWarp; ++j)
      if (lane + j * kWarp == bi) v[j] = -1.f;
  }
  if (lane < top_k) {
    weights[t * top_k + lane] = renormalize ? my_w / picked : my_w;
    ids[t * top_k + lane] = my_id;
  }
}

// ---------------------------------------------------------------- shared arguments

template <typename T>
struct ExpertArgs {
  T* out;               // [T, H]
  const T* x;           // [T, H]
  const T* w13;         // [S, 2I, H]
  const T* w2;          // [S, H, I]
  const int* topk_ids;  // [T, K]
  const float* topk_w;  // [T, K]
  const int* expert_map;
  TileTable tt;
  const int* sorted;  // [pairs] pair ids (t * K + k) grouped by expert
  T* act;             // [pairs, I] silu(gate) * up, by pair id
  float* y;           // [pairs, y_cols] one down-projection column chunk, by pair id
  int tokens, top_k, experts, slots, hidden, inter;
  int64_t y_cols;
};

// ---------------------------------------------------------------- decode (GEMV) path

// Block (tile, 8 rows of I): warp w computes gate row j and up row j for the tile's pairs.
template <typename T, int VEC>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_gate_up_kernel(ExpertArgs<T> a) {
  int tile = blockIdx.x;
  int e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ int s_pair[kGemvRows];
  int rows = a.tt.rows[tile];
  int tid = threadIdx.x;
  if (tid < rows) s_pair[tid] = a.sorted[a.tt.start[tile] + tid];
  __syncthreads();
  int lane = threadIdx.x % kWarp;
  int64_t j = static_cast<int64_t>(blockIdx.y) * kGemvWarps + threadIdx.x / kWarp;
  if (j >= a.inter) return;
  int64_t H = a.hidden, slot = a.expert_map[e];
  const T* gate = a.w13 + (slot * 2 * a.inter + j) * H;
  const T* up = gate + static_cast<int64_t>(a.inter) * H;
  const T* xr[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r)
    xr[r] = a.x + static_cast<int64_t>(r < rows ? s_pair[r] / a.top_k : 0) * H;
  float g[kGemvRows] = {}, u[kGemvRows] = {};
#pragma unroll 2
  for (int64_t h = lane * VEC; h < H; h += kWarp * VEC) {
    Vec<T, VEC> wg = load_vec<T, VEC>(gate + h), wu = load_vec<T, VEC>(up + h);
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r < rows) {
        Vec<T, VEC> xv = load_vec<T, VEC>(xr[r] + h);
        g[r] += dot_vec(wg, xv);
        u[r] += dot_vec(wu, xv);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    if (r < rows) {
      float gs = warp_sum(g[r]), us = warp_sum(u[r]);
      if (lane == 0) {
        a.act[static_cast<int64_t>(s_pair[r]) * a.inter + j] = from_float<T>(silu_mul(gs, us));
      }
    }
  }
}

// Block (token, 8 rows of H): warp w computes out[t, h] = sum_k w_k * (w2_s[h] . act[pair]),
// walking the K * I/VEC vectors flat so every lane keeps independent loads in flight.
template <typename T, int VEC>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_down_kernel(ExpertArgs<T> a) {
  __shared__ int s_slot[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  int64_t t = blockIdx.x;
  int tid = threadIdx.x;
  if (tid < a.top_k) {
    int64_t p = t * a.top_k + tid;
    s_slot[tid] = slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots);
    s_w[tid] = a.topk_w[p];
  }
  __syncthreads();
  int lane = threadIdx.x % kWarp;
  int64_t h = static_cast<int64_t>(blockIdx.y) * kGemvWarps + threadIdx.x / kWarp;
  if (h >= a.hidden) return;
  int64_t I = a.inter, H = a.hidden;
  int nvec = a.inter / VEC, total = a.top_k * nvec;
  float acc = 0.f;
#pragma unroll 4
  for (int f = lane; f < total; f += kWarp) {
    int k = f / nvec;
    int64_t i = static_cast<int64_t>(f - k * nvec) * VEC;
    int s = s_slot[k];
    if (s < 0) continue;
    Vec<T, VEC> wv = load_vec<T, VEC>(a.w2 + (s * H + h) * I + i);
    Vec<T, VEC> av = load_vec<T, VEC>(a.act + (t * a.top_k + k) * I + i);
    acc += s_w[k] * dot_vec(wv, av);
  }
  acc = warp_sum(acc);
  if (lane == 0) a.out[t * H + h] = from_float<T>(acc);
}

// ---------------------------------------------------------------- prefill (tiled) path

// Block (tile, 64 columns of I): C = x rows @ [gate rows | up rows]^T, act = silu(gate) * up.
template <typename T, bool TC, int VEC>
__global__ void __launch_bounds__(kTileThreads) tile_gate_up_kernel(ExpertArgs<T> a) {
  constexpr int BN = 128;
  using L = TileLayout<T, BN>;
  int tile = blockIdx.x;
  int e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ SmemBuf<L::kBytes> sbuf;
  unsigned char* smem = sbuf.bytes;
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  int rows = a.tt.rows[tile], tid = threadIdx.x;
  int64_t H = a.hidden, I = a.inter, j0 = static_cast<int64_t>(blockIdx.y) * 64;
  int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? static_cast<int64_t>(pair / a.top_k) * H : -1;
  }
  {
    int64_t j = j0 + tid % 64;  // tid < 64: gate row j, else up row j
    s_brow[tid] = j < I ? (tid < 64 ? j : I + j) * H : -1;
  }
  __syncthreads();
  tile_gemm<T, BN, TC, VEC>(smem, a.x, s_arow, a.w13 + slot * 2 * I * H, s_brow, H);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * 64; idx += kTileThreads) {
    int r = idx / 64, n = idx % 64;
    if (r < rows && j0 + n < I) {
      float v = silu_mul(C[r * L::kLdc + n], C[r * L::kLdc + 64 + n]);
      a.act[static_cast<int64_t>(s_pair[r]) * I + j0 + n] = from_float<T>(v);
    }
  }
}

// Block (tile, 64 columns of the chunk [c0, c0 + cw) of H): y[pair, n] = act[pair] . w2_s[c0 + n].
template <typename T, bool TC, int VEC>
__global__ void __launch_bounds__(kTileThreads) tile_down_kernel(ExpertArgs<T> a, int64_t c0,
                                                                 int64_t cw) {
  constexpr int BN = 64;
  using L = TileLayout<T, BN>;
  int tile = blockIdx.x;
  int e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ SmemBuf<L::kBytes> sbuf;
  unsigned char* smem = sbuf.bytes;
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  int rows = a.tt.rows[tile], tid = threadIdx.x;
  int64_t I = a.inter, n0 = static_cast<int64_t>(blockIdx.y) * BN;
  int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? pair * I : -1;
  }
  if (tid < BN) s_brow[tid] = n0 + tid < cw ? (c0 + n0 + tid) * I : -1;
  __syncthreads();
  tile_gemm<T, BN, TC, VEC>(smem, a.act, s_arow, a.w2 + slot * a.hidden * I, s_brow, I);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * BN; idx += kTileThreads) {
    int r = idx / BN, n = idx % BN;
    if (r < rows && n0 + n < cw) a.y[s_pair[r] * a.y_cols + n0 + n] = C[r * L::kLdc + n];
  }
}

// out[t, c0 + c] = sum_k w[t,k] * y[t * K + k, c] in k order (pairs without a slot skipped).
template <typename T>
__global__ void combine_kernel(ExpertArgs<T> a, int64_t c0, int64_t cw) {
  int64_t total = static_cast<int64_t>(a.tokens) * cw;
  int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    int64_t t = i / cw, c = i - t * cw;
    float acc = 0.f;
    for (int k = 0; k < a.top_k; ++k) {
      int64_t p = t * a.top_k + k;
      if (slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots) >= 0)
        acc += a.topk_w[p] * a.y[p * a.y_cols + c];
    }
    a.out[t * a.hidden + c0 + c] = from_float<T>(acc);
  }
}

// ---------------------------------------------------------------- host side

template <typename T, int VEC>
void launch_gemv(const ExpertArgs<T>& a, const Plan& plan, cudaStream_t stream) {
  dim3 gu(static_cast<unsigned>(plan.max_tiles),
          static_cast<unsigned>(ceil_div(a.inter, kGemvWarps)));
  gemv_gate_up_kernel<T, VEC><<<gu, kGemvWarps * kWarp, 0, stream>>>(a);
  check_launch("moe gate/up (gemv)");
}

template <typename T, int VEC>
void launch_gemv_down(const ExpertArgs<T>& a, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(a.tokens),
            static_cast<unsigned>(ceil_div(a.hidden, kGemvWarps)));
  gemv_down_kernel<T, VEC><<<grid, kGemvWarps * kWarp, 0, stream>>>(a);
  check_launch("moe down (gemv)");
}

template <typename T, bool TC>
void launch_tiled(const ExpertArgs<T>& a, const Plan& plan, bool vec_h, bool vec_i,
                  cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  unsigned tiles = static_cast<unsigned>(plan.max_tiles);
  dim3 gu(tiles, static_cast<unsigned>(ceil_div(a.inter, 64)));
  if (vec_h) {
    tile_gate_up_kernel<T, TC, V><<<gu, kTileThreads, 0, stream>>>(a);
  } else {
    tile_gate_up_kernel<T, TC, 1><<<gu, kTileThreads, 0, stream>>>(a);
  }
  check_launch("moe gate/up (tiled)");
  for (int64_t c0 = 0; c0 < a.hidden; c0 += a.y_cols) {  // fixed chunk count for given H, I
    int64_t cw = a.hidden - c0 < a.y_cols ? a.hidden - c0 : a.y_cols;
    dim3 gd(tiles, static_cast<unsigned>(ceil_div(cw, 64)));
    if (vec_i) {
      tile_down_kernel<T, TC, V><<<gd, kTileThreads, 0, stream>>>(a, c0, cw);
    } else {
      tile_down_kernel<T, TC, 1><<<gd, kTileThreads, 0, stream>>>(a, c0, cw);
    }
    check_launch("moe down (tiled)");
    int64_t blocks = ceil_div(a.tokens * cw, 256);
    combine_kernel<T><<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(
        a, c0, cw);
    check_launch("moe combine");
  }
}

template <typename T>
void run_experts(ExpertArgs<T> a, const Plan& plan, bool vec_h, bool vec_i, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  moe_align::launch_align(a.tt, const_cast<int*>(a.sorted), a.topk_ids, a.expert_map, plan,
                          a.experts, a.slots, stream);
  if (plan.gemv) {
    if (vec_h) launch_gemv<T, V>(a, plan, stream); else launch_gemv<T, 1>(a, plan, stream);
    if (vec_i) launch_gemv_down<T, V>(a, stream); else launch_gemv_down<T, 1>(a, stream);
    return;
  }
#if defined(__HIP_PLATFORM_AMD__)
  launch_tiled<T, false>(a, plan, vec_h, vec_i, stream);
#else
  if constexpr (sizeof(T) == 2) {
    launch_tiled<T, true>(a, plan, vec_h, vec_i, stream);
  } else {
    launch_tiled<T, false>(a, plan, vec_h, vec_i, stream);
  }
#endif
}

void check_i32(const TensorView& t, const char* name, int ndim, int dev) {
  check_gpu(t, name, dev);
  check_dtype(t, kDLInt, 32, name, "int32");
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
}

/*! \brief Softmax over the router logits [T, E], then the K largest (descending, ties: lower
 * id) into topk_weights f32 [T, K] and topk_ids int32 [T, K]; renormalize divides by their sum.
 */
void moe_topk_softmax(TensorView topk_weights, TensorView topk_ids, TensorView logits,
                      bool renormalize) {
  int dev = logits.device().device_id;
  check_gpu(logits, "logits", dev);
  check_gpu(topk_weights, "topk_weights", dev);
  check_i32(topk_ids, "topk_ids", 2, dev);
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_ndim(topk_weights, 2, "topk_weights");
  check_contiguous(topk_weights, "topk_weights");
  check_ndim(logits, 2, "logits");
  FloatType ft = float_type(logits, "logits");
  RowView rl = row_view(logits, 1, "logits");
  int64_t T = logits.size(0), E = logits.size(1), K = topk_ids.size(1);
  TVM_FFI_ICHECK(topk_weights.size(0) == T && topk_ids.size(0) == T && topk_weights.size(1) == K)
      << "topk_weights and topk_ids must both be [T, K] with T = " << T << " (logits rows)";
  TVM_FFI_ICHECK(E >= 1 && E <= kRouteMaxExperts)
      << "logits: the number of experts must be in 1.." << kRouteMaxExperts << ", got " << E;
  TVM_FFI_ICHECK(K >= 1 && K <= kMaxTopK && K <= E)
      << "topk_ids: top_k must be in 1.." << kMaxTopK << " and <= the number of experts (" << E
      << "), got " << K;
  if (T == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(logits);
  unsigned blocks = static_cast<unsigned>(ceil_div(T, 8));
  FT_CUDA_DISPATCH_FLOAT(ft, L, {
    topk_softmax_kernel<L><<<blocks, 256, 0, stream>>>(
        data_of<float>(topk_weights), data_of<int>(topk_ids), data_of<L>(logits), rl.stride,
        static_cast<int>(T), static_cast<int>(E), static_cast<int>(K), renormalize);
  });
  check_launch("moe_topk_softmax");
}

/*! \brief out[T, H] = sum_k topk_weights[t, k] * expert_{map[ids[t, k]]}(x[t]) (SwiGLU MLPs);
 * w13 [S, 2I, H] (gate rows, then up rows), w2 [S, H, I]; scratch from `workspace`.
 */
void moe_experts(TensorView out, TensorView x, TensorView w13, TensorView w2, TensorView topk_ids,
                 TensorView topk_weights, TensorView expert_map, TensorView workspace) {
  int dev = x.device().device_id;
  const char* names[] = {"out", "x", "w13", "w2"};
  const TensorView* ts[] = {&out, &x, &w13, &w2};
  FloatType ft = float_type(x, "x");
  for (int i = 0; i < 4; ++i) {
    check_gpu(*ts[i], names[i], dev);
    check_same_dtype(*ts[i], x, names[i], "x");
    check_ndim(*ts[i], i < 2 ? 2 : 3, names[i]);
    check_contiguous(*ts[i], names[i]);
  }
  check_i32(topk_ids, "topk_ids", 2, dev);
  check_i32(expert_map, "expert_map", 1, dev);
  check_gpu(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_ndim(topk_weights, 2, "topk_weights");
  check_contiguous(topk_weights, "topk_weights");
  check_gpu(workspace, "workspace", dev);
  check_dtype(workspace, kDLUInt, 8, "workspace", "uint8");
  check_ndim(workspace, 1, "workspace");
  check_contiguous(workspace, "workspace");
  int64_t T = x.size(0), H = x.size(1), S = w13.size(0), I = w2.size(2), K = topk_ids.size(1);
  int64_t E = expert_map.size(0);
  TVM_FFI_ICHECK(out.size(0) == T && out.size(1) == H)
      << "out must be [T, H] = [" << T << ", " << H << "] like x";
  TVM_FFI_ICHECK(S >= 1 && w13.size(1) == 2 * I && w13.size(2) == H)
      << "w13 must be [S, 2I, H] = [S, " << 2 * I << ", " << H << "] (I from w2), got [" << S
      << ", " << w13.size(1) << ", " << w13.size(2) << "]";
  TVM_FFI_ICHECK(w2.size(0) == S && w2.size(1) == H && I >= 1)
      << "w2 must be [S, H, I] = [" << S << ", " << H << ", I] (S, H from w13 and x)";
  TVM_FFI_ICHECK(topk_ids.size(0) == T && topk_weights.size(0) == T && topk_weights.size(1) == K)
      << "topk_ids and topk_weights must both be [T, K] with T = " << T << " (x rows)";
  TVM_FFI_ICHECK(K >= 1 && K <= kMaxTopK) << "topk_ids: top_k must be in 1.." << kMaxTopK
                                          << ", got " << K;
  TVM_FFI_ICHECK(E >= 1 && E <= kMaxExperts)
      << "expert_map: the number of experts must be in 1.." << kMaxExperts << ", got " << E;
  TVM_FFI_ICHECK(T * K < (int64_t{1} << 31) / 2 && H < (int64_t{1} << 31) && I < (int64_t{1} << 31))
      << "moe_experts: T * K, H and I must fit in 31 bits";
  int64_t itemsize = ft == FloatType::kF32 ? 4 : 2;
  Plan plan = make_plan(T, K, E, I, itemsize);
  TVM_FFI_ICHECK(workspace.size(0) >= plan.total)
      << "workspace must hold at least " << plan.total << " bytes (ops.moe_workspace_bytes), got "
      << workspace.size(0);
  TVM_FFI_ICHECK(aligned16(workspace)) << "workspace must be 16-byte aligned";
  if (T == 0 || H == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  char* ws = data_of<char>(workspace);
  int vec = 16 / static_cast<int>(itemsize);
  bool vec_h = H % vec == 0 && aligned16(x) && aligned16(w13);
  bool vec_i = I % vec == 0 && aligned16(w2);
  FT_CUDA_DISPATCH_FLOAT(ft, Tp, {
    ExpertArgs<Tp> a;
    a.out = data_of<Tp>(out);
    a.x = data_of<Tp>(x);
    a.w13 = data_of<Tp>(w13);
    a.w2 = data_of<Tp>(w2);
    a.topk_ids = data_of<int>(topk_ids);
    a.topk_w = data_of<float>(topk_weights);
    a.expert_map = data_of<int>(expert_map);
    int* tiles = reinterpret_cast<int*>(ws + plan.off_tiles);
    a.tt = TileTable{tiles, tiles + plan.max_tiles, tiles + 2 * plan.max_tiles};
    a.sorted = reinterpret_cast<int*>(ws + plan.off_sorted);
    a.act = reinterpret_cast<Tp*>(ws + plan.off_act);
    a.y = reinterpret_cast<float*>(ws + plan.off_y);
    a.tokens = static_cast<int>(T);
    a.top_k = static_cast<int>(K);
    a.experts = static_cast<int>(E);
    a.slots = static_cast<int>(S);
    a.hidden = static_cast<int>(H);
    a.inter = static_cast<int>(I);
    a.y_cols = plan.y_cols;
    run_experts<Tp>(a, plan, vec_h, vec_i, stream);
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_topk_softmax, freetoken::moe_topk_softmax);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts, freetoken::moe_experts);
