// The routed experts' SwiGLU MLPs over GGUF blocks kept in VRAM: moe_experts with w13
// [S, 2I, row_bytes] and w2 [S, H, row_bytes] uint8 tensors of Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K
// rows (gate/up and down may differ in type, as in the _M mixes); activations bf16.
//
// The launch sequence is moe.cu's, fixed on the host from (T, K, E) alone (graph-capturable,
// no host sync, no allocation), over the same workspace plan and alignment pass
// (freetoken/moe_align.cuh):
//  - decode (few pairs): gate/up per tile of <= 8 pairs of one expert, one warp per row j of I;
//    each lane takes 32-weight units and dots them with every pair's x (gguf::dot32: the scales
//    applied once per unit, as gguf_gemm's GEMV does), SwiGLU in registers, bf16 act. The down
//    projection runs per token, summing its K experts in a fixed order.
//  - prefill (tiles of 64 pairs): grouped GEMMs whose weight slices are decoded to bf16 in
//    shared memory (freetoken/moe_gguf_tile.cuh), the SwiGLU in the gate/up epilogue, f32 down
//    rows per pair in column chunks, then the per-token sum over K.
// Weights are decoded by gguf_blocks.h, the reader the host test checks against gguf.
// NOTE: over 300 lines because both paths share the argument block and the host dispatch.
#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"
#include "freetoken/moe_align.cuh"
#include "freetoken/moe_gguf_tile.cuh"

namespace freetoken {
namespace {

using gguf::Block;
using moe_align::kGemvRows;
using moe_align::Plan;
using moe_align::silu_mul;
using moe_align::slot_of;
using moe_align::TileTable;
using moe_gguf_tile::kThreads;
using moe_gguf_tile::kTM;
using moe_gguf_tile::Layout;
static_assert(moe_align::kTileRows == kTM, "the plan's prefill tiles are the GEMM tile's rows");

constexpr int kGemvWarps = 8;

struct QArgs {
  bf16* out;              // [T, H]
  const bf16* x;          // [T, H]
  const uint8_t* w13;     // [S, 2I, rb13]
  const uint8_t* w2;      // [S, H, rb2]
  int64_t rb13, rb2;      // bytes per weight row
  const int* topk_ids;    // [T, K]
  const float* topk_w;    // [T, K]
  const int* expert_map;
  TileTable tt;
  const int* sorted;  // [pairs] pair ids (t * K + k) grouped by expert
  bf16* act;          // [pairs, I] silu(gate) * up, by pair id
  float* y;           // [pairs, y_cols] one down-projection column chunk, by pair id
  int tokens, top_k, experts, slots, hidden, inter;
  int64_t y_cols;
};

// x[0..32) as floats and the sums of its halves (dot32's inputs); p 16-byte aligned.
__device__ __forceinline__ void load32(const bf16* p, float* xv, float* xlo, float* xhi) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    Vec<bf16, 8> v = load_vec<bf16, 8>(p + 8 * i);
#pragma unroll
    for (int e = 0; e < 8; ++e) xv[8 * i + e] = to_float(v.v[e]);
  }
  float lo = 0.f, hi = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    lo += xv[i];
    hi += xv[16 + i];
  }
  *xlo = lo;
  *xhi = hi;
}

// ---------------------------------------------------------------- decode (GEMV) path

// Block (tile, 8 rows of I): warp w computes gate row j and up row j for the tile's pairs.
template <int QT>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_gate_up_kernel(QArgs a) {
  using B = Block<QT>;
  constexpr int kUnits = B::kWeights / 32;
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ int s_pair[kGemvRows];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  if (tid < rows) s_pair[tid] = a.sorted[a.tt.start[tile] + tid];
  __syncthreads();
  const int lane = tid % kWarp;
  const int64_t j = static_cast<int64_t>(blockIdx.y) * kGemvWarps + tid / kWarp;
  if (j >= a.inter) return;
  const int64_t H = a.hidden, I = a.inter, slot = a.expert_map[e];
  const uint8_t* gate = a.w13 + (slot * 2 * I + j) * a.rb13;
  const uint8_t* up = gate + I * a.rb13;
  float g[kGemvRows] = {}, u[kGemvRows] = {};
  for (int64_t gi = lane; gi < H / 32; gi += kWarp) {
    const int64_t boff = (gi / kUnits) * B::kBytes;
    const int unit = static_cast<int>(gi % kUnits);
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) {
      if (r < rows) {
        float xv[32], xlo, xhi;
        load32(a.x + static_cast<int64_t>(s_pair[r] / a.top_k) * H + gi * 32, xv, &xlo, &xhi);
        g[r] += gguf::dot32<QT>(gate + boff, unit, xv, xlo, xhi);
        u[r] += gguf::dot32<QT>(up + boff, unit, xv, xlo, xhi);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    if (r < rows) {
      const float gs = warp_sum(g[r]), us = warp_sum(u[r]);
      if (lane == 0) a.act[static_cast<int64_t>(s_pair[r]) * I + j] = from_float<bf16>(
          silu_mul(gs, us));
    }
  }
}

// Block (token, 8 rows of H): warp w computes out[t, h] = sum_k w_k * (w2_s[h] . act[pair]),
// walking the K * I/32 units flat so every lane has work.
template <int QT>
__global__ void __launch_bounds__(kGemvWarps * kWarp) gemv_down_kernel(QArgs a) {
  using B = Block<QT>;
  constexpr int kUnits = B::kWeights / 32;
  __shared__ int s_slot[moe_align::kMaxTopK];
  __shared__ float s_w[moe_align::kMaxTopK];
  const int64_t t = blockIdx.x;
  const int tid = threadIdx.x;
  if (tid < a.top_k) {
    const int64_t p = t * a.top_k + tid;
    s_slot[tid] = slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots);
    s_w[tid] = a.topk_w[p];
  }
  __syncthreads();
  const int lane = tid % kWarp;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kGemvWarps + tid / kWarp;
  if (h >= a.hidden) return;
  const int64_t I = a.inter, H = a.hidden, units = I / 32, total = a.top_k * units;
  float acc = 0.f;
  for (int64_t f = lane; f < total; f += kWarp) {
    const int k = static_cast<int>(f / units);
    const int64_t gi = f - k * units;
    const int64_t s = s_slot[k];
    if (s < 0) continue;
    const uint8_t* row = a.w2 + (s * H + h) * a.rb2 + (gi / kUnits) * B::kBytes;
    float xv[32], xlo, xhi;
    load32(a.act + (t * a.top_k + k) * I + gi * 32, xv, &xlo, &xhi);
    acc += s_w[k] * gguf::dot32<QT>(row, static_cast<int>(gi % kUnits), xv, xlo, xhi);
  }
  acc = warp_sum(acc);
  if (lane == 0) a.out[t * H + h] = from_float<bf16>(acc);
}

// ---------------------------------------------------------------- prefill (tiled) path

// Block (tile, 64 columns of I): C = x rows @ [gate rows | up rows]^T, act = silu(gate) * up.
template <int QT>
__global__ void __launch_bounds__(kThreads) tile_gate_up_kernel(QArgs a) {
  constexpr int BN = 128;
  using L = Layout<BN>;
  static_assert(BN == kThreads, "one B row offset per thread");
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ __attribute__((aligned(128))) unsigned char smem[L::kBytes];
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  const int64_t H = a.hidden, I = a.inter, j0 = static_cast<int64_t>(blockIdx.y) * 64;
  const int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    const int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? static_cast<int64_t>(pair / a.top_k) * H : -1;
  }
  {
    const int64_t j = j0 + tid % 64;  // tid < 64: gate row j, else up row j
    s_brow[tid] = j < I ? (slot * 2 * I + (tid < 64 ? j : I + j)) * a.rb13 : -1;
  }
  __syncthreads();
  moe_gguf_tile::tile_gemm<QT, BN>(smem, a.x, s_arow, a.w13, s_brow, H);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * 64; idx += kThreads) {
    const int r = idx / 64, n = idx % 64;
    if (r < rows && j0 + n < I) {
      const float v = silu_mul(C[r * L::kLdc + n], C[r * L::kLdc + 64 + n]);
      a.act[static_cast<int64_t>(s_pair[r]) * I + j0 + n] = from_float<bf16>(v);
    }
  }
}

// Block (tile, 64 columns of the chunk [c0, c0 + cw) of H): y[pair, n] = act[pair] . w2_s[c0 + n].
template <int QT>
__global__ void __launch_bounds__(kThreads) tile_down_kernel(QArgs a, int64_t c0, int64_t cw) {
  constexpr int BN = 64;
  using L = Layout<BN>;
  const int tile = blockIdx.x, e = a.tt.expert[tile];
  if (e < 0) return;
  __shared__ __attribute__((aligned(128))) unsigned char smem[L::kBytes];
  __shared__ int64_t s_arow[kTM], s_brow[BN];
  __shared__ int s_pair[kTM];
  const int rows = a.tt.rows[tile], tid = threadIdx.x;
  const int64_t I = a.inter, n0 = static_cast<int64_t>(blockIdx.y) * BN;
  const int64_t slot = a.expert_map[e];
  if (tid < kTM) {
    const int pair = tid < rows ? a.sorted[a.tt.start[tile] + tid] : -1;
    s_pair[tid] = pair;
    s_arow[tid] = pair >= 0 ? pair * I : -1;
  }
  if (tid < BN) s_brow[tid] = n0 + tid < cw ? (slot * a.hidden + c0 + n0 + tid) * a.rb2 : -1;
  __syncthreads();
  moe_gguf_tile::tile_gemm<QT, BN>(smem, a.act, s_arow, a.w2, s_brow, I);
  const float* C = reinterpret_cast<const float*>(smem);
  for (int idx = tid; idx < kTM * BN; idx += kThreads) {
    const int r = idx / BN, n = idx % BN;
    if (r < rows && n0 + n < cw) a.y[s_pair[r] * a.y_cols + n0 + n] = C[r * L::kLdc + n];
  }
}

// out[t, c0 + c] = sum_k w[t,k] * y[t * K + k, c] in k order (pairs without a slot skipped).
__global__ void combine_kernel(QArgs a, int64_t c0, int64_t cw) {
  const int64_t total = static_cast<int64_t>(a.tokens) * cw;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const int64_t t = i / cw, c = i - t * cw;
    float acc = 0.f;
    for (int k = 0; k < a.top_k; ++k) {
      const int64_t p = t * a.top_k + k;
      if (slot_of(a.topk_ids[p], a.expert_map, a.experts, a.slots) >= 0)
        acc += a.topk_w[p] * a.y[p * a.y_cols + c];
    }
    a.out[t * a.hidden + c0 + c] = from_float<bf16>(acc);
  }
}

// ---------------------------------------------------------------- host side

#define FT_MOE_GGUF_DISPATCH(qtype, QT, ...)                                    \
  switch (qtype) {                                                             \
    case gguf::kQ4_0: { constexpr int QT = gguf::kQ4_0; __VA_ARGS__; break; } \
    case gguf::kQ4_1: { constexpr int QT = gguf::kQ4_1; __VA_ARGS__; break; } \
    case gguf::kQ8_0: { constexpr int QT = gguf::kQ8_0; __VA_ARGS__; break; } \
    case gguf::kQ4_K: { constexpr int QT = gguf::kQ4_K; __VA_ARGS__; break; } \
    case gguf::kQ5_K: { constexpr int QT = gguf::kQ5_K; __VA_ARGS__; break; } \
    case gguf::kQ6_K: { constexpr int QT = gguf::kQ6_K; __VA_ARGS__; break; } \
    default: TVM_FFI_ICHECK(false) << "unsupported GGUF type " << qtype;      \
  }

void run_experts(const QArgs& a, const Plan& plan, int q13, int q2, cudaStream_t stream) {
  moe_align::launch_align(a.tt, const_cast<int*>(a.sorted), a.topk_ids, a.expert_map, plan,
                          a.experts, a.slots, stream);
  const unsigned tiles = static_cast<unsigned>(plan.max_tiles);
  if (plan.gemv) {
    dim3 gu(tiles, static_cast<unsigned>(ceil_div(a.inter, kGemvWarps)));
    FT_MOE_GGUF_DISPATCH(q13, QT, (gemv_gate_up_kernel<QT><<<gu, kGemvWarps * kWarp, 0,
                                                              stream>>>(a)));
    check_launch("moe_experts_gguf gate/up (gemv)");
    dim3 gd(static_cast<unsigned>(a.tokens), static_cast<unsigned>(ceil_div(a.hidden,
                                                                            kGemvWarps)));
    FT_MOE_GGUF_DISPATCH(q2, QT, (gemv_down_kernel<QT><<<gd, kGemvWarps * kWarp, 0, stream>>>(a)));
    check_launch("moe_experts_gguf down (gemv)");
    return;
  }
  dim3 gu(tiles, static_cast<unsigned>(ceil_div(a.inter, 64)));
  FT_MOE_GGUF_DISPATCH(q13, QT, (tile_gate_up_kernel<QT><<<gu, kThreads, 0, stream>>>(a)));
  check_launch("moe_experts_gguf gate/up (tiled)");
  for (int64_t c0 = 0; c0 < a.hidden; c0 += a.y_cols) {  // fixed chunk count for given H, I
    const int64_t cw = a.hidden - c0 < a.y_cols ? a.hidden - c0 : a.y_cols;
    dim3 gd(tiles, static_cast<unsigned>(ceil_div(cw, 64)));
    FT_MOE_GGUF_DISPATCH(q2, QT, (tile_down_kernel<QT><<<gd, kThreads, 0, stream>>>(a, c0, cw)));
    check_launch("moe_experts_gguf down (tiled)");
    const int64_t blocks = ceil_div(a.tokens * cw, 256);
    combine_kernel<<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(
        a, c0, cw);
    check_launch("moe_experts_gguf combine");
  }
}

void check_tensor(const TensorView& t, const char* name, int dev, DLDataTypeCode code, int bits,
                  const char* dtype, int ndim) {
  check_gpu(t, name, dev);
  check_dtype(t, code, bits, name, dtype);
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
}

/*! \brief Bytes per row of `weights` weights of `qtype`; raises naming `name` and the type. */
int64_t row_bytes_of(int64_t qtype, int64_t weights, const char* name, const char* dim) {
  int bw = 0, bb = 0;
  gguf::block_shape(static_cast<int>(qtype), &bw, &bb);
  TVM_FFI_ICHECK(bw > 0) << name << ": GGUF type " << qtype
                         << " is not one the GPU reads (Q4_0 2, Q4_1 3, Q8_0 8, Q4_K 12, "
                            "Q5_K 13, Q6_K 14)";
  TVM_FFI_ICHECK(weights % bw == 0) << name << ": rows of " << bw << "-weight blocks need " << dim
                                    << " a multiple of " << bw << ", got " << weights;
  return weights / bw * bb;
}

/*! \brief moe_experts over GGUF blocks: out, x bf16 [T, H]; w13 uint8 [S, 2I, row_bytes] (gate
 * rows, then up rows) of type qtype13; w2 uint8 [S, H, row_bytes] of type qtype2. */
void moe_experts_gguf(TensorView out, TensorView x, TensorView w13, TensorView w2,
                      int64_t qtype13, int64_t qtype2, TensorView topk_ids,
                      TensorView topk_weights, TensorView expert_map, TensorView workspace) {
  const int dev = x.device().device_id;
  check_tensor(x, "x", dev, kDLBfloat, 16, "bfloat16", 2);
  check_tensor(out, "out", dev, kDLBfloat, 16, "bfloat16", 2);
  check_tensor(w13, "w13", dev, kDLUInt, 8, "uint8", 3);
  check_tensor(w2, "w2", dev, kDLUInt, 8, "uint8", 3);
  check_tensor(topk_ids, "topk_ids", dev, kDLInt, 32, "int32", 2);
  check_tensor(topk_weights, "topk_weights", dev, kDLFloat, 32, "float32", 2);
  check_tensor(expert_map, "expert_map", dev, kDLInt, 32, "int32", 1);
  check_tensor(workspace, "workspace", dev, kDLUInt, 8, "uint8", 1);
  const int64_t T = x.size(0), H = x.size(1), S = w13.size(0), I = w13.size(1) / 2;
  const int64_t K = topk_ids.size(1), E = expert_map.size(0);
  TVM_FFI_ICHECK(out.size(0) == T && out.size(1) == H)
      << "out must be [T, H] = [" << T << ", " << H << "] like x";
  TVM_FFI_ICHECK(S >= 1 && I >= 1 && w13.size(1) == 2 * I)
      << "w13 must be [S, 2I, row_bytes] with S, I >= 1, got [" << S << ", " << w13.size(1)
      << ", " << w13.size(2) << "]";
  const int64_t rb13 = row_bytes_of(qtype13, H, "w13", "H");
  const int64_t rb2 = row_bytes_of(qtype2, I, "w2", "I");
  TVM_FFI_ICHECK(w13.size(2) == rb13) << "w13 rows must hold H = " << H << " weights: " << rb13
                                      << " bytes, got " << w13.size(2);
  TVM_FFI_ICHECK(w2.size(0) == S && w2.size(1) == H && w2.size(2) == rb2)
      << "w2 must be [S, H, row_bytes] = [" << S << ", " << H << ", " << rb2
      << "] (I = " << I << " weights a row), got [" << w2.size(0) << ", " << w2.size(1) << ", "
      << w2.size(2) << "]";
  TVM_FFI_ICHECK(topk_ids.size(0) == T && topk_weights.size(0) == T && topk_weights.size(1) == K)
      << "topk_ids and topk_weights must both be [T, K] with T = " << T << " (x rows)";
  TVM_FFI_ICHECK(K >= 1 && K <= moe_align::kMaxTopK)
      << "topk_ids: top_k must be in 1.." << moe_align::kMaxTopK << ", got " << K;
  TVM_FFI_ICHECK(E >= 1 && E <= moe_align::kMaxExperts)
      << "expert_map: the number of experts must be in 1.." << moe_align::kMaxExperts << ", got "
      << E;
  TVM_FFI_ICHECK(T * K < (int64_t{1} << 31) / 2 && H < (int64_t{1} << 31) && I < (int64_t{1} << 31))
      << "moe_experts_gguf: T * K, H and I must fit in 31 bits";
  const Plan plan = moe_align::make_plan(T, K, E, I, 2);
  TVM_FFI_ICHECK(workspace.size(0) >= plan.total)
      << "workspace must hold at least " << plan.total << " bytes (ops.moe_workspace_bytes), got "
      << workspace.size(0);
  TVM_FFI_ICHECK(aligned16(workspace)) << "workspace must be 16-byte aligned";
  TVM_FFI_ICHECK(aligned16(x)) << "x must be 16-byte aligned";
  if (T == 0 || H == 0) return;
  DeviceGuard guard(dev);
  QArgs a;
  a.out = data_of<bf16>(out);
  a.x = data_of<bf16>(x);
  a.w13 = data_of<uint8_t>(w13);
  a.w2 = data_of<uint8_t>(w2);
  a.rb13 = rb13;
  a.rb2 = rb2;
  a.topk_ids = data_of<int>(topk_ids);
  a.topk_w = data_of<float>(topk_weights);
  a.expert_map = data_of<int>(expert_map);
  int* sorted = nullptr;
  moe_align::carve(data_of<char>(workspace), plan, &a.tt, &sorted, &a.act, &a.y);
  a.sorted = sorted;
  a.tokens = static_cast<int>(T);
  a.top_k = static_cast<int>(K);
  a.experts = static_cast<int>(E);
  a.slots = static_cast<int>(S);
  a.hidden = static_cast<int>(H);
  a.inter = static_cast<int>(I);
  a.y_cols = plan.y_cols;
  run_experts(a, plan, static_cast<int>(qtype13), static_cast<int>(qtype2), stream_for(x));
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_gguf, freetoken::moe_experts_gguf);
