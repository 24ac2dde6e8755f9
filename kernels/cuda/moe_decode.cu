// MoE decode for small steps (T <= 8 tokens) in two launches after the routing, every expert
// byte streamed once in 16-byte loads:
//
//  moe_decode_gate_up  one block per (pair p = t * K + k, tile of 8 rows of I), one warp per
//                      row: act[q] = silu(gate_s . x_t) * (up_s . x_t) for every pair q routed
//                      to the same expert as p. The first such pair's blocks own the expert and
//                      run all of its tokens, the others exit, so an expert two tokens share is
//                      read once (no align pass: the T * K ids are scanned in shared memory).
//                      Extra blocks run the shared expert's gate/up and its sigmoid-gate logit.
//  moe_decode_down     one block per (token, tile of 8 rows of H), one warp per row: the warp
//                      walks the token's K experts' rows in a fixed order (no atomics) and
//                      writes y = sum_k w_k * (down_s . act) [+ sigmoid(g) * shared], or adds
//                      it to the residual stream.
//
// `variant` picks a launch shape (moe_decode_kernels.cuh kVariants; 0 the default): kind 0 is
// the layout above; kind 1 (streamed) runs gate/up as one wave of blocks whose warps take the
// row pairs in turn, and down as blocks of whole rows whose warps split the (expert, row) dots,
// launched as a programmatic dependent of gate/up on sm_90+ when the variant says so.
// Slots come from topk_ids through expert_map (offload slot pools; an unmapped expert is
// skipped, as in moe_experts). No host sync: the launch shape depends on (T, K, I) alone.
// Rounding follows the unfused chain: gate, up and the shared products are rounded to the
// dtype before their SwiGLU / gate, the routed sum once, the residual add once.
#include "freetoken/cuda_common.cuh"
#include "freetoken/moe_decode_kernels.cuh"

namespace freetoken {
namespace {

using moe_decode::DecodeArgs;
using moe_decode::down_kernel;
using moe_decode::down_stream_kernel;
using moe_decode::gate_up_blocks;
using moe_decode::gate_up_kernel;
using moe_decode::gate_up_stream_blocks;
using moe_decode::gate_up_stream_kernel;
using moe_decode::kMaxExperts;
using moe_decode::kMaxTokens;
using moe_decode::kMaxTopK;
using moe_decode::kNumVariants;
using moe_decode::kVariants;
using moe_decode::kRows;
using moe_decode::kThreads;

// ---------------------------------------------------------------- host side

template <typename T, int NT, int V>
void launch_gate_up_shape(const DecodeArgs& a, int device, cudaStream_t stream) {
  constexpr moe_decode::Variant k = kVariants[V];
  if constexpr (k.kind == 1) {
    dim3 grid(static_cast<unsigned>(gate_up_stream_blocks(a, sm_count(device), k.min_blocks)));
    gate_up_stream_kernel<T, NT, k.unroll, k.min_blocks><<<grid, kThreads, 0, stream>>>(a);
  } else {
    dim3 grid(static_cast<unsigned>(gate_up_blocks(a, k.rows)));
    gate_up_kernel<T, NT, k.rows, k.unroll, k.min_blocks><<<grid, kThreads, 0, stream>>>(a);
  }
}

// Variants 1.. are built for the steps models/forward/moe_decode.py sends here (1-2 tokens,
// which also keeps the build short); wider steps run variant 0.
template <typename T, int V = kNumVariants - 1>
void launch_gate_up(const DecodeArgs& a, int variant, int device, cudaStream_t stream) {
  if constexpr (V > 0) {
    if (variant == V && a.tokens <= 2) {
      a.tokens <= 1 ? launch_gate_up_shape<T, 1, V>(a, device, stream)
                    : launch_gate_up_shape<T, 2, V>(a, device, stream);
      return;
    }
    launch_gate_up<T, V - 1>(a, variant, device, stream);
  } else {
    if (a.tokens <= 1) {
      launch_gate_up_shape<T, 1, 0>(a, device, stream);
    } else if (a.tokens <= 2) {
      launch_gate_up_shape<T, 2, 0>(a, device, stream);
    } else if (a.tokens <= 4) {
      launch_gate_up_shape<T, 4, 0>(a, device, stream);
    } else {
      launch_gate_up_shape<T, 8, 0>(a, device, stream);
    }
  }
}

template <typename T, int V>
void launch_down_variant(const DecodeArgs& a, int device, cudaStream_t stream) {
  constexpr moe_decode::Variant k = kVariants[V];
  const unsigned tokens = static_cast<unsigned>(a.tokens);
  if constexpr (k.kind == 1) {
    auto* kernel = down_stream_kernel<T, k.rows, k.units, k.vecs, k.down_blocks>;
    dim3 grid(tokens, static_cast<unsigned>(ceil_div(a.hidden, k.rows)));
    launch_maybe_pdl(kernel, grid, dim3(kThreads), stream, k.pdl, device, a);
  } else {
    dim3 grid(tokens, static_cast<unsigned>(ceil_div(a.hidden, kRows * k.rows)));
    down_kernel<T, k.rows, k.unroll, k.min_blocks><<<grid, kThreads, 0, stream>>>(a);
  }
}

template <typename T, int V = kNumVariants - 1>
void launch_down(const DecodeArgs& a, int variant, int device, cudaStream_t stream) {
  if constexpr (V > 0) {
    if (variant == V) return launch_down_variant<T, V>(a, device, stream);
    launch_down<T, V - 1>(a, variant, device, stream);
  } else {
    launch_down_variant<T, 0>(a, device, stream);
  }
}

int check_variant(int64_t variant, int count) {
  TVM_FFI_ICHECK(variant >= 0 && variant < count)
      << "variant must be in 0.." << count - 1 << ", got " << variant;
  return static_cast<int>(variant);
}

void check_rows(const TensorView& t, int dev, const TensorView& like, const char* name,
                int64_t rows, int64_t cols, int64_t* stride) {
  check_gpu(t, name, dev);
  check_same_dtype(t, like, name, "x");
  check_ndim(t, 2, name);
  RowView rv = row_view(t, 1, name);
  TVM_FFI_ICHECK(t.size(0) == rows && rv.width == cols)
      << name << " must be [" << rows << ", " << cols << "], got [" << t.size(0) << ", "
      << rv.width << "]";
  TVM_FFI_ICHECK(rv.stride % 8 == 0 && aligned16(t))
      << name << " rows must start on 16-byte boundaries (row stride a multiple of 8)";
  *stride = rv.stride;
}

void check_weight(const TensorView& t, int dev, const TensorView& like, const char* name,
                  int ndim) {
  check_gpu(t, name, dev);
  check_same_dtype(t, like, name, "x");
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
  TVM_FFI_ICHECK(aligned16(t)) << name << " must be 16-byte aligned";
}

// Checks the arguments both kernels share and fills the routed half of `a`.
DecodeArgs routed_args(const TensorView& x, const TensorView& w13, const TensorView& w2,
                       const TensorView& topk_ids, const TensorView& expert_map,
                       const TensorView& workspace) {
  int dev = x.device().device_id;
  FloatType ft = float_type(x, "x");
  TVM_FFI_ICHECK(ft != FloatType::kF32) << "moe decode takes bfloat16 or float16, not float32";
  check_weight(w13, dev, x, "w13", 3);
  check_weight(w2, dev, x, "w2", 3);
  int64_t S = w13.size(0), I = w13.size(1) / 2, H = w13.size(2), T = topk_ids.size(0);
  TVM_FFI_ICHECK(w13.size(1) % 2 == 0 && H % 8 == 0 && I % 8 == 0)
      << "w13 must be [S, 2I, H] with H and I multiples of 8";
  TVM_FFI_ICHECK(w2.size(0) == S && w2.size(1) == H && w2.size(2) == I)
      << "w2 must be [S, H, I] = [" << S << ", " << H << ", " << I << "] (from w13)";
  check_gpu(topk_ids, "topk_ids", dev);
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  check_ndim(topk_ids, 2, "topk_ids");
  check_contiguous(topk_ids, "topk_ids");
  int64_t K = topk_ids.size(1), E = expert_map.size(0);
  TVM_FFI_ICHECK(T <= kMaxTokens) << "moe decode takes at most " << kMaxTokens
                                  << " tokens, got " << T;
  TVM_FFI_ICHECK(K >= 1 && K <= kMaxTopK) << "top_k must be in 1.." << kMaxTopK << ", got " << K;
  check_gpu(expert_map, "expert_map", dev);
  check_dtype(expert_map, kDLInt, 32, "expert_map", "int32");
  TVM_FFI_ICHECK(expert_map.ndim() == 1 && expert_map.IsContiguous() && E >= 1 &&
                 E <= kMaxExperts)
      << "expert_map must be a contiguous int32 [E] with 1 <= E <= " << kMaxExperts;
  check_gpu(workspace, "workspace", dev);
  int64_t need = T * K * I * 2;
  TVM_FFI_ICHECK(workspace.ndim() == 1 && workspace.IsContiguous() && aligned16(workspace) &&
                 workspace.size(0) * (workspace.dtype().bits / 8) >= need)
      << "workspace must be a contiguous, 16-byte aligned buffer of at least " << need
      << " bytes (T * K * I activations)";
  DecodeArgs a{};
  a.x = data_of<void>(x);
  a.w13 = data_of<void>(w13);
  a.w2 = data_of<void>(w2);
  a.topk_ids = data_of<int>(topk_ids);
  a.expert_map = data_of<int>(expert_map);
  a.act = data_of<void>(workspace);
  a.tokens = static_cast<int>(T);
  a.top_k = static_cast<int>(K);
  a.experts = static_cast<int>(E);
  a.slots = static_cast<int>(S);
  a.hidden = static_cast<int>(H);
  a.inter = static_cast<int>(I);
  return a;
}

// The shared expert's operands: all given, or w13/w2/act all absent (gate optional).
void shared_args(DecodeArgs* a, const TensorView& x, tvm::ffi::Optional<TensorView> sh_w13,
                 tvm::ffi::Optional<TensorView> sh_w2, tvm::ffi::Optional<TensorView> sh_act,
                 tvm::ffi::Optional<TensorView> sh_gate_w,
                 tvm::ffi::Optional<TensorView> sh_gate, bool need_w13, bool need_w2) {
  int dev = x.device().device_id;
  if (!sh_act.has_value()) {
    TVM_FFI_ICHECK(!sh_gate_w.has_value() && !sh_gate.has_value())
        << "a shared-expert gate needs the shared expert (shared_act)";
    return;
  }
  int64_t H = a->hidden;
  if (need_w13) {
    TVM_FFI_ICHECK(sh_w13.has_value()) << "shared_act given without shared_w13";
    check_weight(sh_w13.value(), dev, x, "shared_w13", 2);
    a->sh_w13 = data_of<void>(sh_w13.value());
    a->sh_inter = static_cast<int>(sh_w13.value().size(0) / 2);
    TVM_FFI_ICHECK(sh_w13.value().size(1) == H && sh_w13.value().size(0) % 16 == 0)
        << "shared_w13 must be [2Is, " << H << "] with Is a multiple of 8";
  }
  if (need_w2) {
    TVM_FFI_ICHECK(sh_w2.has_value()) << "shared_act given without shared_w2";
    check_weight(sh_w2.value(), dev, x, "shared_w2", 2);
    a->sh_w2 = data_of<void>(sh_w2.value());
    a->sh_inter = static_cast<int>(sh_w2.value().size(1));
    TVM_FFI_ICHECK(sh_w2.value().size(0) == H && a->sh_inter % 8 == 0)
        << "shared_w2 must be [" << H << ", Is] with Is a multiple of 8";
  }
  check_rows(sh_act.value(), dev, x, "shared_act", a->tokens, a->sh_inter, &a->sh_act_stride);
  a->sh_act = data_of<void>(sh_act.value());
  if (!sh_gate.has_value()) return;
  check_gpu(sh_gate.value(), "shared_gate", dev);
  check_same_dtype(sh_gate.value(), x, "shared_gate", "x");
  RowView rv = row_view(sh_gate.value(), 1, "shared_gate");
  TVM_FFI_ICHECK(sh_gate.value().ndim() == 2 && rv.rows == a->tokens && rv.width == 1)
      << "shared_gate must be [" << a->tokens << ", 1]";
  a->sh_gate = data_of<void>(sh_gate.value());
  a->sh_gate_stride = rv.stride;
  if (need_w13) {
    TVM_FFI_ICHECK(sh_gate_w.has_value()) << "shared_gate given without shared_gate_weight";
    check_weight(sh_gate_w.value(), dev, x, "shared_gate_weight", 2);
    TVM_FFI_ICHECK(sh_gate_w.value().size(0) == 1 && sh_gate_w.value().size(1) == H)
        << "shared_gate_weight must be [1, " << H << "]";
    a->sh_gate_w = data_of<void>(sh_gate_w.value());
  } else {
    a->sh_gate_w = a->sh_gate;  // down: marks "gated"; it reads only sh_gate
  }
}

/*! \brief act[T*K, I] (in workspace) and the shared expert's act / gate logit; see the top. */
void moe_decode_gate_up(TensorView x, TensorView w13, TensorView w2, TensorView topk_ids,
                        TensorView expert_map, TensorView workspace,
                        tvm::ffi::Optional<TensorView> shared_w13,
                        tvm::ffi::Optional<TensorView> shared_act,
                        tvm::ffi::Optional<TensorView> shared_gate_weight,
                        tvm::ffi::Optional<TensorView> shared_gate, int64_t variant) {
  int v = check_variant(variant, kNumVariants);
  DecodeArgs a = routed_args(x, w13, w2, topk_ids, expert_map, workspace);
  int dev = x.device().device_id;
  check_rows(x, dev, x, "x", a.tokens, a.hidden, &a.x_stride);
  shared_args(&a, x, shared_w13, tvm::ffi::Optional<TensorView>(), shared_act,
              shared_gate_weight, shared_gate, true, false);
  if (a.tokens == 0) return;
  DeviceGuard guard(dev);
  if (float_type(x, "x") == FloatType::kBF16) {
    launch_gate_up<bf16>(a, v, dev, stream_for(x));
  } else {
    launch_gate_up<f16>(a, v, dev, stream_for(x));
  }
  check_launch("moe_decode_gate_up");
}

/*! \brief out[T, H] (+)= sum_k w_k down_s(act) [+ sigmoid(gate) * shared_down(shared_act)]. */
void moe_decode_down(TensorView out, TensorView w13, TensorView w2, TensorView topk_ids,
                     TensorView topk_weights, TensorView expert_map, TensorView workspace,
                     tvm::ffi::Optional<TensorView> shared_w2,
                     tvm::ffi::Optional<TensorView> shared_act,
                     tvm::ffi::Optional<TensorView> shared_gate, bool accumulate,
                     int64_t variant) {
  int v = check_variant(variant, kNumVariants);
  DecodeArgs a = routed_args(out, w13, w2, topk_ids, expert_map, workspace);
  int dev = out.device().device_id;
  check_rows(out, dev, out, "out", a.tokens, a.hidden, &a.out_stride);
  check_gpu(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  TVM_FFI_ICHECK(topk_weights.ndim() == 2 && topk_weights.IsContiguous() &&
                 topk_weights.size(0) == a.tokens && topk_weights.size(1) == a.top_k)
      << "topk_weights must be a contiguous float32 [T, K] like topk_ids";
  a.out = data_of<void>(out);
  a.topk_w = data_of<float>(topk_weights);
  a.accumulate = accumulate;
  shared_args(&a, out, tvm::ffi::Optional<TensorView>(), shared_w2, shared_act,
              tvm::ffi::Optional<TensorView>(), shared_gate, false, true);
  if (a.tokens == 0) return;
  DeviceGuard guard(dev);
  if (float_type(out, "out") == FloatType::kBF16) {
    launch_down<bf16>(a, v, dev, stream_for(out));
  } else {
    launch_down<f16>(a, v, dev, stream_for(out));
  }
  check_launch("moe_decode_down");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_decode_gate_up, freetoken::moe_decode_gate_up);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_decode_down, freetoken::moe_decode_down);
