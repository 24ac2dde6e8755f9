// The routed experts' SwiGLU MLPs over GGUF blocks kept in VRAM: moe_experts with w13
// [S, 2I, row_bytes] and w2 [S, H, row_bytes] uint8 tensors of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/
// Q5_K/Q6_K rows (gate/up and down may differ in type, as in the _M mixes); activations bf16.
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
// Weights are decoded by gguf_blocks.h, the reader the host test checks against gguf; the
// kernels live in freetoken/moe_gguf_kernels.cuh, which a host build runs on CPU threads.
#include "freetoken/cuda_common.cuh"
#include "freetoken/moe_gguf_kernels.cuh"

namespace freetoken {
namespace {

using moe_align::Plan;
using moe_gguf::combine_kernel;
using moe_gguf::gemv_down_kernel;
using moe_gguf::gemv_gate_up_kernel;
using moe_gguf::kGemvWarps;
using moe_gguf::QArgs;
using moe_gguf::tile_down_kernel;
using moe_gguf::tile_gate_up_kernel;
using moe_gguf_tile::kThreads;

// ---------------------------------------------------------------- host side

#define FT_MOE_GGUF_DISPATCH(qtype, QT, ...)                                    \
  switch (qtype) {                                                             \
    case gguf::kQ4_0: { constexpr int QT = gguf::kQ4_0; __VA_ARGS__; break; } \
    case gguf::kQ4_1: { constexpr int QT = gguf::kQ4_1; __VA_ARGS__; break; } \
    case gguf::kQ5_0: { constexpr int QT = gguf::kQ5_0; __VA_ARGS__; break; } \
    case gguf::kQ5_1: { constexpr int QT = gguf::kQ5_1; __VA_ARGS__; break; } \
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
                         << " is not one the GPU reads (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, "
                            "Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)";
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
  // rows are their blocks, or those padded to whole 16-byte words (weights.gpu_rows)
  const int64_t rb13 = w13.size(2), rb2 = w2.size(2);
  const int64_t data13 = row_bytes_of(qtype13, H, "w13", "H");
  const int64_t data2 = row_bytes_of(qtype2, I, "w2", "I");
  TVM_FFI_ICHECK(gguf::row_holds(static_cast<int>(qtype13), H, rb13))
      << "w13 rows must hold H = " << H << " weights: " << data13 << " bytes (or those padded "
      << "to 16-byte words), got " << rb13;
  TVM_FFI_ICHECK(w2.size(0) == S && w2.size(1) == H && gguf::row_holds(static_cast<int>(qtype2),
                                                                        I, rb2))
      << "w2 must be [S, H, row_bytes] = [" << S << ", " << H << ", " << data2
      << " or that padded to 16 bytes] (I = " << I << " weights a row), got [" << w2.size(0)
      << ", " << w2.size(1) << ", " << w2.size(2) << "]";
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
