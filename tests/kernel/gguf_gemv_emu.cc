// Host run of the float-activation GGUF decode GEMV (kernels/cuda/quant_gemv.cu, its kernel
// part) on CPU threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh, every
// type, rows-per-warp and token instantiation as gguf_gemv launches them; checked by
// tests/kernel/test_gguf_gemv_emulated.py.
#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

#include "../../kernels/cuda/quant_gemv.cu"

namespace qg = freetoken::quant_gemv;
namespace gg = freetoken::gguf;
using freetoken::bf16;
using freetoken::emu::launch;

// out (f32 when out_f32, else bf16 bits), x: bf16 bits, rows ldx apart; w: [n, row_bytes]
// blocks of qtype. Returns 0 for what the real entry point refuses, else 1.
extern "C" int ft_gguf_gemv_emu(void* out, int out_f32, const void* x, const void* w,
                                long ldx, long ldo, int tokens, long n, long k, int qtype,
                                int rows) {
  int weights = 0, block_bytes = 0;
  gg::block_shape(qtype, &weights, &block_bytes);
  const long rb = weights ? k / weights * block_bytes : 0;
  const bool read = qtype == gg::kQ4_0 || qtype == gg::kQ5_0 || qtype == gg::kQ5_1 ||
                    qtype == gg::kQ8_0 || qtype == gg::kQ4_K || qtype == gg::kQ6_K;
  if (!read || k % weights != 0 || rb % 16 != 0 || tokens < 1 || tokens > qg::kMaxTokens ||
      (rows != 0 && rows != 1 && rows != 2 && rows != 4)) {
    return 0;
  }
  qg::with_rows_tokens(rows, tokens, [&](auto r, auto nt) {
    constexpr int R = decltype(r)::value, NT = decltype(nt)::value;
    const auto grid = static_cast<unsigned>(freetoken::ceil_div(n, qg::kWarps * R));
    auto go = [&](auto kernel) {
      launch(grid, 1, qg::kWarps * freetoken::kWarp, [&] {
        kernel(out, out_f32 != 0, static_cast<const bf16*>(x), static_cast<const uint8_t*>(w),
               tokens, n, k, rb, ldx, ldo);
      });
    };
    switch (qtype) {
      case gg::kQ4_0: go(freetoken::gguf_gemv_kernel<gg::kQ4_0, R, NT>); break;
      case gg::kQ5_0: go(freetoken::gguf_gemv_kernel<gg::kQ5_0, R, NT>); break;
      case gg::kQ5_1: go(freetoken::gguf_gemv_kernel<gg::kQ5_1, R, NT>); break;
      case gg::kQ8_0: go(freetoken::gguf_gemv_kernel<gg::kQ8_0, R, NT>); break;
      case gg::kQ4_K: go(freetoken::gguf_gemv_kernel<gg::kQ4_K, R, NT>); break;
      default: go(freetoken::gguf_gemv_kernel<gg::kQ6_K, R, NT>); break;
    }
  });
  return 1;
}
