// Mixture-of-Experts on the CPU: softmax top-k routing, and the routed experts' SwiGLU MLPs
// with f32 activations over f32 weights (moe_experts) or GGUF rows (moe_experts_quant), run by
// the engine in moe_cpu_experts.h.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "freetoken/cpu_common.h"
#include "freetoken/moe_cpu_experts.h"
#include "freetoken/quant_dispatch.h"
#include "freetoken/quant_packed.h"

namespace freetoken {
namespace moe {
namespace {

void moe_experts(TensorView out, TensorView x, TensorView w13, TensorView w2, TensorView topk_ids,
                 TensorView topk_weights, TensorView expert_map, TensorView workspace) {
  const Format f32{floatrows::kF32, false};
  run_experts(quant::best_isa(), out, x, w13, w2, f32, f32, false, topk_ids, topk_weights,
              expert_map, workspace);
}

void moe_experts_quant_isa(TensorView out, TensorView x, TensorView w13, TensorView w2,
                           int64_t qtype13, int64_t qtype2, TensorView topk_ids,
                           TensorView topk_weights, TensorView expert_map, TensorView workspace,
                           std::string isa) {
  run_experts(quant::parse_isa(isa), out, x, w13, w2, format_of(qtype13, "qtype13"),
              format_of(qtype2, "qtype2"), true, topk_ids, topk_weights, expert_map, workspace);
}

void moe_experts_quant(TensorView out, TensorView x, TensorView w13, TensorView w2,
                       int64_t qtype13, int64_t qtype2, TensorView topk_ids,
                       TensorView topk_weights, TensorView expert_map, TensorView workspace) {
  moe_experts_quant_isa(out, x, w13, w2, qtype13, qtype2, topk_ids, topk_weights, expert_map,
                        workspace, quant::isa_name(quant::best_isa()));
}

// A GGUF expert tensor that quant_pack rewrote: its type has the packed layout, this CPU runs
// it, and every task of run_experts starts on a whole tile (`rows_of_task` a multiple of 16).
Format packed_format(int64_t type, const char* name, int64_t rows_of_task, const char* dim) {
  Format f = format_of(type, name);
  TVM_FFI_ICHECK(quant::packable_type(type))
      << name << " = " << type << " has no packed layout: only Q4_0 (2), Q4_1 (3), Q5_0 (6), "
      << "Q5_1 (7), Q8_0 (8), Q4_K (12) and Q6_K (14)";
  TVM_FFI_ICHECK(quant::best_isa() == Isa::kAvx512)
      << "packed experts need AVX-512 VNNI, which this CPU lacks (best: "
      << quant::isa_name(quant::best_isa()) << "); keep the GGUF layout (moe_experts_quant)";
  TVM_FFI_ICHECK(rows_of_task % quant::kPackRows == 0)
      << "packed experts need " << dim << " to be a multiple of " << quant::kPackRows << ", not "
      << rows_of_task;
  f.packed = true;
  return f;
}

// moe_experts_quant where w13 and/or w2 hold packed rows (packed13 / packed2).
void moe_experts_quant_packed(TensorView out, TensorView x, TensorView w13, TensorView w2,
                              int64_t qtype13, int64_t qtype2, bool packed13, bool packed2,
                              TensorView topk_ids, TensorView topk_weights,
                              TensorView expert_map, TensorView workspace) {
  TVM_FFI_ICHECK(w13.ndim() == 3) << "w13 must be [S, 2I, row bytes], got " << dims_of(w13);
  const Format f13 = packed13 ? packed_format(qtype13, "qtype13", w13.size(1) / 2, "I")
                              : format_of(qtype13, "qtype13");
  const Format f2 = packed2 ? packed_format(qtype2, "qtype2", x.size(1), "H")
                            : format_of(qtype2, "qtype2");
  run_experts(quant::best_isa(), out, x, w13, w2, f13, f2, true, topk_ids, topk_weights,
              expert_map, workspace);
}

// ------------------------------------------------------------------ routing

// Softmax over one row of E logits, then its K largest probabilities in descending order (ties:
// lower expert first). Selection runs on the logits, which softmax orders the same way.
template <typename T>
void topk_row(const T* logits, int64_t e, int64_t k, bool renormalize, float* wout,
              int32_t* iout) {
  float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t j = 0; j < e; ++j) top = std::max(top, to_float(logits[j]));
  for (int64_t j = 0; j < e; ++j) sum += std::exp(to_float(logits[j]) - top);
  int64_t n = 0;
  for (int64_t j = 0; j < e; ++j) {
    const float v = to_float(logits[j]);
    if (n == k && !(v > wout[k - 1])) continue;
    int64_t at = n < k ? n++ : k - 1;
    for (; at > 0 && v > wout[at - 1]; --at) {
      wout[at] = wout[at - 1];
      iout[at] = iout[at - 1];
    }
    wout[at] = v;
    iout[at] = static_cast<int32_t>(j);
  }
  float kept = 0.f;
  for (int64_t r = 0; r < k; ++r) kept += wout[r] = std::exp(wout[r] - top) / sum;
  if (renormalize) {
    for (int64_t r = 0; r < k; ++r) wout[r] /= kept;
  }
}

void moe_topk_softmax(TensorView topk_weights, TensorView topk_ids, TensorView logits,
                      bool renormalize) {
  const FloatType ft = float_type(logits, "logits");
  check_contiguous(logits, "logits");
  check_ndim(logits, 2, "logits");
  const int64_t t = logits.size(0), e = logits.size(1);
  check_contiguous(topk_weights, "topk_weights");
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_contiguous(topk_ids, "topk_ids");
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  TVM_FFI_ICHECK(topk_ids.ndim() == 2 && topk_ids.size(0) == t)
      << "topk_ids must be [T=" << t << ", K], got " << dims_of(topk_ids);
  const int64_t k = topk_ids.size(1);
  TVM_FFI_ICHECK(k >= 1 && k <= e) << "top-k K=" << k << " (topk_ids' last dim) must be in [1, E="
                                   << e << "] (logits' last dim)";
  TVM_FFI_ICHECK(topk_weights.ndim() == 2 && topk_weights.size(0) == t &&
                 topk_weights.size(1) == k)
      << "topk_weights must be [T=" << t << ", K=" << k << "] like topk_ids, got "
      << dims_of(topk_weights);
  float* wp = data_of<float>(topk_weights);
  int32_t* ip = data_of<int32_t>(topk_ids);
  FT_DISPATCH_FLOAT(ft, T, {
    const T* lp = data_of<const T>(logits);
    auto rows = [&](int64_t t0, int64_t t1) {
      for (int64_t r = t0; r < t1; ++r) topk_row(lp + r * e, e, k, renormalize, wp + r * k, ip + r * k);
    };
    if (t * e < 8192) {
      rows(0, t);
    } else {
      parallel_for(t, std::max<int64_t>(1, 4096 / e), rows);
    }
  });
}

}  // namespace
}  // namespace moe
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_topk_softmax, freetoken::moe::moe_topk_softmax);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts, freetoken::moe::moe_experts);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_quant_packed, freetoken::moe::moe_experts_quant_packed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_quant, freetoken::moe::moe_experts_quant);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_quant_isa, freetoken::moe::moe_experts_quant_isa);
