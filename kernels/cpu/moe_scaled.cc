// Routed SwiGLU experts over FP8 expert weights on the CPU (moe_experts_scaled): the engine of
// moe_cpu_experts.h, reading each routed expert's e4m3 codes once and applying its block
// scales in registers (floatrows' e4m3 tiles). Any number of tokens: prefill runs here too,
// since only the routed experts' bytes are read.
#include "freetoken/cpu_common.h"
#include "freetoken/moe_cpu_experts.h"
#include "freetoken/scaled_cpu_args.h"

namespace freetoken {
namespace moe {
namespace {

/*!
 * \brief moe_experts_scaled's contract (kernel/ops.py) on the CPU: out, x f32 [T, H]; w13 uint8
 * [S, 2I, H] and w2 uint8 [S, H, I] of e4m3 codes, each with a float32 scale grid
 * [S, ceil(rows / bn), ceil(cols / bk)] and row scales [S, rows]. `act` is the GPU's scratch:
 * the CPU keeps its own buffers, so any CPU tensor will do.
 */
void moe_experts_scaled(TensorView out, TensorView x, TensorView w13, TensorView w13_scales,
                        TensorView w13_rows, TensorView w2, TensorView w2_scales,
                        TensorView w2_rows, int64_t format, int64_t bn13, int64_t bk13,
                        int64_t bn2, int64_t bk2, TensorView topk_ids, TensorView topk_weights,
                        TensorView expert_map, TensorView act) {
  scaled::check_format(format);
  Format f13{floatrows::kE4M3, false}, f2{floatrows::kE4M3, false};
  f13.fp8 = scaled::check_fp8(w13, w13_scales, w13_rows, bn13, bk13, 3, "w13", "w13_scales",
                              "w13_rows");
  f2.fp8 = scaled::check_fp8(w2, w2_scales, w2_rows, bn2, bk2, 3, "w2", "w2_scales", "w2_rows");
  TVM_FFI_ICHECK(f13.fp8.slots == f2.fp8.slots)
      << "w13 and w2 must hold the same expert slots, got " << f13.fp8.slots << " and "
      << f2.fp8.slots;
  run_experts(quant::best_isa(), out, x, w13, w2, f13, f2, true, topk_ids, topk_weights,
              expert_map, act);
}

}  // namespace
}  // namespace moe
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_experts_scaled, freetoken::moe::moe_experts_scaled);
