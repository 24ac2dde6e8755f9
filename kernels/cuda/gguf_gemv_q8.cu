// gguf_gemv_q8: the decode GEMV (1-8 tokens) over GGUF rows on int8 activations, with the fused
// decode step's prologue and epilogues (FREETOKEN_QUANT_GEMV=v3), and the MoE decode step over
// GGUF experts (moe_q8_gate_up, moe_q8_down). The kernels, their layout and their numerics are
// described in freetoken/gguf_gemv_q8_kernels.cuh; this file holds the launches and the checks.
#include "freetoken/gguf_gemv_q8_kernels.cuh"

namespace freetoken {
namespace {

using namespace gemv_q8;

// One launch of the instantiation dispatch<MODE, GATHER> picks, `grid_y` block rows (1, the
// MoE pairs or the tokens), its x extent one wave of blocks on this device's SMs at most.
template <int MODE, int GATHER = kDense>
void launch_mode(const Args& args, int qtype, int64_t rows, bool pdl, int device,
                 cudaStream_t stream, unsigned grid_y = 1) {
  Args a = args;
  a.grid_y = static_cast<int>(grid_y);
  a.sms = sm_count(device);
  const bool launched = dispatch<MODE, GATHER>(
      a, qtype, rows, [&](auto kernel, unsigned blocks, int threads) {
        launch_maybe_pdl(kernel, dim3(blocks, grid_y), dim3(threads), stream, pdl, device, a);
      });
  TVM_FFI_ICHECK(launched) << "gguf_gemv_q8: no kernel reads qtype " << qtype;
}

/*!
 * \brief The decode product over GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K rows (whole
 * blocks padded to 16-byte words) on int8-quantized activations.
 * mode 0: out[T, N] = xn @ W.T (+ bias), out bf16 or f32, may be a column slice;
 * mode 1: out[T, N] += xn @ W.T (out bf16, the residual; the product rounded first);
 * mode 2: out[T, N] = silu(g) * u, [g | u] = xn @ W.T with W [2N, K] (out bf16).
 * xn = rms_norm(x) * norm_weight when norm_weight is given, else x (bf16, T <= 8 rows for
 * Q4_K, Q6_K and Q8_0, 2 for the others; T * K <= 32768 for Q4_K, 24576 for the others). rows: Q4_K weight rows per warp, 0 (by T), 1 or 2
 * (the other types take one). pdl: launch as a programmatic dependent where the device has it.
 */
void gguf_gemv_q8(TensorView out, TensorView x, TensorView qweight, int64_t qtype,
                  tvm::ffi::Optional<TensorView> bias, tvm::ffi::Optional<TensorView> norm_weight,
                  double eps, int64_t mode, int64_t rows, bool pdl) {
  const int dev = qweight.device().device_id;
  int weights = 0, block_bytes = 0;
  gguf::block_shape(static_cast<int>(qtype), &weights, &block_bytes);
  TVM_FFI_ICHECK(weights > 0)
      << "gguf_gemv_q8 reads Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K "
      << "(13) and Q6_K (14), got qtype " << qtype;
  TVM_FFI_ICHECK(mode == kStore || mode == kAddResidual || mode == kSwiGLU)
      << "mode must be 0 (store), 1 (residual add) or 2 (SwiGLU), got " << mode;
  TVM_FFI_ICHECK(rows == 0 || rows == 1 || rows == 2)
      << "rows (weight rows per warp) must be 0 (automatic), 1 or 2, got " << rows;
  check_gpu(qweight, "qweight", dev);
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_ndim(qweight, 2, "qweight");
  check_contiguous(qweight, "qweight");
  TVM_FFI_ICHECK(aligned16(qweight)) << "qweight must start on a 16-byte boundary";
  // a row is its blocks, padded to whole 16-byte words (less than one block of padding)
  const int64_t rb = qweight.size(1), k = rb / block_bytes * weights;
  TVM_FFI_ICHECK(gguf::row_holds(static_cast<int>(qtype), k, rb) && rb % 16 == 0)
      << "qweight rows must be whole blocks of " << block_bytes << " bytes padded to a multiple "
      << "of 16 bytes, got " << rb << " bytes (gguf_matmul takes any row)";
  const int64_t n_rows = qweight.size(0), n = mode == kSwiGLU ? n_rows / 2 : n_rows;
  TVM_FFI_ICHECK(mode != kSwiGLU || n_rows % 2 == 0) << "gate_up must have 2*I rows";
  check_dtype(x, kDLBfloat, 16, "x", "bfloat16");
  check_aligned_rows(x, dev, "x", k);
  const int64_t tokens = x.size(0);
  const int most = max_tokens(static_cast<int>(qtype));
  TVM_FFI_ICHECK(tokens <= most && tokens * k <= capacity(static_cast<int>(qtype)))
      << "gguf_gemv_q8 takes at most " << most << " rows of x and "
      << capacity(static_cast<int>(qtype)) << " values in all for qtype " << qtype << ", got "
      << tokens << " x " << k << " (gguf_gemv takes more)";
  const bool f32 = has_dtype(out, kDLFloat, 32);
  TVM_FFI_ICHECK(!f32 || mode == kStore) << "a float32 out is for mode 0 only";
  check_gpu(out, "out", dev);
  check_ndim(out, 2, "out");
  TVM_FFI_ICHECK(f32 || has_dtype(out, kDLBfloat, 16))
      << "out must be bfloat16 (or float32 in mode 0), got " << dtype_name(out.dtype());
  RowView ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(ro.rows == tokens && ro.width == n)
      << "out must be [" << tokens << ", " << n << "] (x rows, output columns)";
  TVM_FFI_ICHECK(!bias.has_value() || mode == kStore) << "a bias is for mode 0 only";
  auto check_vector = [&](const TensorView& v, int64_t size, const char* name) {
    check_gpu(v, name, dev);
    check_dtype(v, kDLBfloat, 16, name, "bfloat16");
    TVM_FFI_ICHECK(v.ndim() == 1 && v.size(0) == size && v.IsContiguous() && aligned16(v))
        << name << " must be a contiguous, 16-byte aligned [" << size << "] tensor";
  };
  if (bias.has_value()) check_vector(bias.value(), n, "bias");
  if (norm_weight.has_value()) check_vector(norm_weight.value(), k, "norm_weight");
  if (tokens == 0 || n == 0) return;
  Args a{data_of<void>(out), data_of<bf16>(x), data_of<uint8_t>(qweight),
         bias.has_value() ? data_of<bf16>(bias.value()) : nullptr,
         norm_weight.has_value() ? data_of<bf16>(norm_weight.value()) : nullptr,
         n, k, rb, row_view(x, 1, "x").stride, ro.stride, static_cast<int>(tokens), f32,
         static_cast<float>(eps)};
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(qweight);
  const int qt = static_cast<int>(qtype);
  if (mode == kStore) launch_mode<kStore>(a, qt, rows, pdl, dev, stream);
  if (mode == kAddResidual) launch_mode<kAddResidual>(a, qt, rows, pdl, dev, stream);
  if (mode == kSwiGLU) launch_mode<kSwiGLU>(a, qt, rows, pdl, dev, stream);
  check_launch("gguf_gemv_q8");
}


// ---------------------------------------------------------------- the MoE decode halves

/*! \brief The routing operands both halves take: ids [T, K] int32 and expert_map [E] int32 on
 * the device; their sizes into `a`. */
void check_routing(Args* a, const TensorView& topk_ids, const TensorView& expert_map,
                   int64_t tokens, int dev) {
  check_gpu(topk_ids, "topk_ids", dev);
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  check_ndim(topk_ids, 2, "topk_ids");
  check_contiguous(topk_ids, "topk_ids");
  check_gpu(expert_map, "expert_map", dev);
  check_dtype(expert_map, kDLInt, 32, "expert_map", "int32");
  check_ndim(expert_map, 1, "expert_map");
  check_contiguous(expert_map, "expert_map");
  const int64_t k = topk_ids.size(1), e = expert_map.size(0);
  TVM_FFI_ICHECK(topk_ids.size(0) == tokens && tokens >= 1 && tokens <= kMaxMoETokens)
      << "topk_ids must be [T, K] with 1 <= T <= " << kMaxMoETokens << " (x rows), got ["
      << topk_ids.size(0) << ", " << k << "]";
  TVM_FFI_ICHECK(k >= 1 && k <= kMaxTopK) << "top_k must be in 1.." << kMaxTopK << ", got " << k;
  TVM_FFI_ICHECK(e >= 1 && e < (int64_t{1} << 31)) << "expert_map must hold 1.. experts";
  a->gather = kDense;
  a->topk_ids = data_of<int>(topk_ids);
  a->expert_map = data_of<int>(expert_map);
  a->top_k = static_cast<int>(k);
  a->experts = static_cast<int>(e);
}

/*! \brief Stacked experts [S, rows, row_bytes] of GGUF type qtype holding `weights` weights a
 * row: checked, and their row bytes. Each slot's rows are contiguous; slots may lie further
 * apart than one matrix (stride(0) >= rows * row_bytes, in 16-byte steps: an expert-offload
 * pool whose slots are sized for the model's widest expert), which `slot_bytes` returns. */
int64_t check_experts(const TensorView& w, int64_t qtype, int64_t rows, int64_t weights,
                      const char* name, int dev, int64_t* slot_bytes) {
  int per_block = 0, block_bytes = 0;
  gguf::block_shape(static_cast<int>(qtype), &per_block, &block_bytes);
  TVM_FFI_ICHECK(per_block > 0)
      << name << ": the MoE decode reads Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K "
      << "(12), Q5_K (13) and Q6_K (14), got qtype " << qtype;
  check_gpu(w, name, dev);
  check_dtype(w, kDLUInt, 8, name, "uint8");
  check_ndim(w, 3, name);
  TVM_FFI_ICHECK(aligned16(w)) << name << " must start on a 16-byte boundary";
  const int64_t rb = (weights / per_block * block_bytes + 15) / 16 * 16;  // padded to words
  TVM_FFI_ICHECK(weights % per_block == 0 && w.size(1) == rows && w.size(2) == rb)
      << name << " must be [S, " << rows << ", " << rb << "] (rows of " << weights
      << " weights in whole " << block_bytes << "-byte blocks, padded to 16 bytes), got ["
      << w.size(0) << ", " << w.size(1) << ", " << w.size(2) << "]";
  TVM_FFI_ICHECK(w.size(0) >= 1 && w.size(0) < (int64_t{1} << 31)) << name << ": no expert slots";
  const int64_t matrix = rows * rb;
  TVM_FFI_ICHECK(w.stride(2) == 1 && w.stride(1) == rb &&
                 (w.size(0) == 1 || (w.stride(0) >= matrix && w.stride(0) % 16 == 0)))
      << name << ": each slot's rows must be contiguous and slots at least " << matrix
      << " bytes apart in 16-byte steps, got strides [" << w.stride(0) << ", " << w.stride(1)
      << ", " << w.stride(2) << "]";
  *slot_bytes = w.size(0) == 1 ? matrix : w.stride(0);
  return rb;
}

/*!
 * \brief act[p] = silu(gate_s . x_t) * (up_s . x_t) for every routed pair p = t * K + k, with
 * slot s = expert_map[topk_ids[t, k]] (zeros for a pair without a slot); x bf16 [T, H] (rows
 * 16-byte aligned), w13 uint8 [S, 2I, row_bytes] (gate rows, then up rows) of qtype, act
 * bf16 [T * K, I] contiguous. H a multiple of the block's weights, H <= the type's staging.
 * rows: Q4_K weight rows per warp (0 or 1: one; 2: two, half the blocks).
 */
void moe_q8_gate_up(TensorView act, TensorView x, TensorView w13, int64_t qtype,
                    TensorView topk_ids, TensorView expert_map, int64_t rows, bool pdl) {
  const int dev = w13.device().device_id;
  TVM_FFI_ICHECK(rows >= 0 && rows <= 2)
      << "rows (Q4_K weight rows per warp) must be 0 (one), 1 or 2, got " << rows;
  check_dtype(x, kDLBfloat, 16, "x", "bfloat16");
  check_ndim(x, 2, "x");
  const int64_t tokens = x.size(0), h = x.size(1);
  check_aligned_rows(x, dev, "x", h);
  Args a{};
  check_routing(&a, topk_ids, expert_map, tokens, dev);
  TVM_FFI_ICHECK(w13.ndim() == 3 && w13.size(1) % 2 == 0)
      << "w13 must be [S, 2I, row_bytes] with gate rows then up rows";
  const int64_t inter = w13.size(1) / 2;
  int64_t slot_bytes = 0;
  const int64_t rb = check_experts(w13, qtype, 2 * inter, h, "w13", dev, &slot_bytes);
  TVM_FFI_ICHECK(h <= capacity(static_cast<int>(qtype)))
      << "moe_q8_gate_up stages at most " << capacity(static_cast<int>(qtype))
      << " values of x for qtype " << qtype << ", got H = " << h;
  check_gpu(act, "act", dev);
  check_dtype(act, kDLBfloat, 16, "act", "bfloat16");
  check_contiguous(act, "act");
  TVM_FFI_ICHECK(act.ndim() == 2 && act.size(0) == tokens * a.top_k && act.size(1) == inter)
      << "act must be [T * K, I] = [" << tokens * a.top_k << ", " << inter << "]";
  a.out = data_of<void>(act);
  a.x = data_of<bf16>(x);
  a.w = data_of<uint8_t>(w13);
  a.n = inter;
  a.k = h;
  a.row_bytes = rb;
  a.ldx = row_view(x, 1, "x").stride;
  a.ldo = inter;
  a.tokens = 1;
  a.gather = kExpertGateUp;
  a.slots = static_cast<int>(w13.size(0));
  a.expert_bytes = slot_bytes;
  DeviceGuard guard(dev);
  launch_mode<kSwiGLU, kExpertGateUp>(a, static_cast<int>(qtype), rows, pdl, dev,
                                      stream_for(w13), static_cast<unsigned>(tokens * a.top_k));
  check_launch("moe_q8_gate_up");
}

/*!
 * \brief out[t] (+)= sum_k topk_weights[t, k] * (down_s . act[t * K + k]) with the slots of
 * moe_q8_gate_up (a pair without one adds nothing): act bf16 [T * K, I] contiguous, w2 uint8
 * [S, H, row_bytes] of qtype, out bf16 [T, H] (rows may be strided); accumulate adds to out
 * (the residual stream), rounding the sum to bf16 first. I a multiple of the block's weights
 * (of 256 for Q4_K); K * I within the type's staging. rows: as moe_q8_gate_up's.
 */
void moe_q8_down(TensorView out, TensorView act, TensorView w2, int64_t qtype,
                 TensorView topk_ids, TensorView topk_weights, TensorView expert_map,
                 bool accumulate, int64_t rows, bool pdl) {
  const int dev = w2.device().device_id;
  TVM_FFI_ICHECK(rows >= 0 && rows <= 2)
      << "rows (Q4_K weight rows per warp) must be 0 (one), 1 or 2, got " << rows;
  check_gpu(out, "out", dev);
  check_dtype(out, kDLBfloat, 16, "out", "bfloat16");
  check_ndim(out, 2, "out");
  const int64_t tokens = out.size(0);
  Args a{};
  check_routing(&a, topk_ids, expert_map, tokens, dev);
  check_gpu(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_contiguous(topk_weights, "topk_weights");
  TVM_FFI_ICHECK(topk_weights.ndim() == 2 && topk_weights.size(0) == tokens &&
                 topk_weights.size(1) == a.top_k)
      << "topk_weights must be [T, K] like topk_ids";
  check_gpu(act, "act", dev);
  check_dtype(act, kDLBfloat, 16, "act", "bfloat16");
  check_contiguous(act, "act");
  TVM_FFI_ICHECK(act.ndim() == 2 && act.size(0) == tokens * a.top_k)
      << "act must be [T * K, I] with T * K = " << tokens * a.top_k << " rows";
  TVM_FFI_ICHECK(aligned16(act)) << "act must start on a 16-byte boundary";
  const int64_t inter = act.size(1);
  TVM_FFI_ICHECK(w2.ndim() == 3) << "w2 must be [S, H, row_bytes]";
  const int64_t h = w2.size(1);
  int64_t slot_bytes = 0;
  const int64_t rb = check_experts(w2, qtype, h, inter, "w2", dev, &slot_bytes);
  TVM_FFI_ICHECK(qtype != gguf::kQ4_K || inter % kBlockWeights == 0)
      << "moe_q8_down reads Q4_K rows of whole 256-weight blocks: I must be a multiple of 256, "
      << "got " << inter;
  TVM_FFI_ICHECK(a.top_k * inter <= capacity(static_cast<int>(qtype)))
      << "moe_q8_down stages K * I <= " << capacity(static_cast<int>(qtype))
      << " activations for qtype " << qtype << ", got " << a.top_k << " x " << inter;
  RowView ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(ro.width == h) << "out must be [T, H] with H = " << h << " (w2 rows)";
  a.out = data_of<void>(out);
  a.x = data_of<bf16>(act);
  a.w = data_of<uint8_t>(w2);
  a.n = h;
  a.k = a.top_k * inter;
  a.row_bytes = rb;
  a.ldx = a.k;
  a.ldo = ro.stride;
  a.tokens = 1;
  a.gather = kExpertDown;
  a.topk_w = data_of<float>(topk_weights);
  a.slots = static_cast<int>(w2.size(0));
  a.expert_bytes = slot_bytes;
  a.seg = inter;
  DeviceGuard guard(dev);
  const int qt = static_cast<int>(qtype);
  const unsigned grid_y = static_cast<unsigned>(tokens);
  if (accumulate) {
    launch_mode<kAddResidual, kExpertDown>(a, qt, rows, pdl, dev, stream_for(w2), grid_y);
  } else {
    launch_mode<kStore, kExpertDown>(a, qt, rows, pdl, dev, stream_for(w2), grid_y);
  }
  check_launch("moe_q8_down");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gguf_gemv_q8, freetoken::gguf_gemv_q8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_q8_gate_up, freetoken::moe_q8_gate_up);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_q8_down, freetoken::moe_q8_down);
