// Host run of the FP8 decode GEMV (kernels/cuda/fp8_gemv.cu, its kernel part) on CPU threads
// through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every rows-per-warp and
// token instantiation, the three epilogues and the norm prologue, launched through the kernel's
// own dispatch; checked by tests/kernel/test_fp8_gemv_emulated.py. bf16 activations.
#include <cmath>

#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "../../kernels/cuda/fp8_gemv.cu"

namespace fk = freetoken::fp8_kernel;
using freetoken::bf16;
using freetoken::emu::launch;

namespace {

template <int MODE>
void run_mode(const fk::Args& a, int rows) {
  fk::dispatch<bf16, MODE>(a, rows, [&](auto kernel, unsigned blocks) {
    launch(blocks, 1, fk::kWarps * freetoken::kWarp, [&] { kernel(a); });
  });
}

}  // namespace

// out, x, bias (or null), norm (or null): bf16 bit patterns; data: [rows, k] e4m3 bytes (2n
// rows for mode 2); scales: float32 [ceil(rows / bn), grid_cols]; row_scale: float32 [rows].
// bk_shift: log2 of the block width (30: one block across the row). Returns 0 for what the
// real entry point refuses (it raises there), else 1.
extern "C" int ft_fp8_gemv_emu(void* out, const void* x, const void* data, const float* scales,
                               const float* row_scale, const void* bias, const void* norm,
                               long ldx, long ldo, int tokens, int rows_total, int k, int bn,
                               int bk_shift, int grid_cols, int mode, int rows, float eps) {
  const int n = mode == fk::kSwiGLU ? rows_total / 2 : rows_total;
  if (tokens < 1 || tokens > fk::kMaxTokens || k % 16 != 0 || ldx % 8 != 0 || bk_shift < 4 ||
      (rows != 0 && rows != 1 && rows != 2 && rows != 4) || mode < 0 || mode > 2 ||
      (mode == fk::kSwiGLU && rows_total % 2 != 0)) {
    return 0;
  }
  const fk::Args a{out, x, static_cast<const uint8_t*>(data),
                   fk::Fp8Grid{scales, row_scale, bn < rows_total ? bn : rows_total, bk_shift,
                               grid_cols},
                   bias, norm, tokens, n, k, ldx, ldo, eps};
  if (mode == fk::kStore) run_mode<fk::kStore>(a, rows);
  if (mode == fk::kAddResidual) run_mode<fk::kAddResidual>(a, rows);
  if (mode == fk::kSwiGLU) run_mode<fk::kSwiGLU>(a, rows);
  return 1;
}
