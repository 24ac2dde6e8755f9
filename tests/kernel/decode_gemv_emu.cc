// Host run of the decode GEMV (kernels/cuda/decode_gemv.cu, its kernel part) on CPU threads
// through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every variant of
// freetoken/gemv_knobs.cuh (block size, unroll, pipelined loads; cache hints and programmatic
// launch are GPU-only and fall back to plain loads / no waits, as on HIP), every token-count
// instantiation, epilogue and the norm prologue, checked by
// tests/kernel/test_decode_gemv_emulated.py.
#include <cmath>
#include <thread>

#include "freetoken/cuda_common.cuh"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "../../kernels/cuda/decode_gemv.cu"

namespace fe = freetoken::emu;
namespace ft = freetoken;
using freetoken::bf16;

namespace {

// Runs body() as gx blocks of `threads` threads, one block at a time (as moe_gguf_emu.cc):
// after each block every thread meets at `next`, whose completion gives the next block fresh
// barriers (a thread that left the kernel early dropped out of the old ones).
template <typename F>
void launch(unsigned gx, unsigned threads, F body) {
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> lanes(threads);
  fe::BlockState state{nullptr, &warps, lanes.data()};
  auto fresh = [&]() noexcept {
    all = std::make_unique<std::barrier<>>(threads);
    warps.clear();
    for (unsigned w = 0; w * 32 < threads; ++w)
      warps.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - w * 32)));
    state.all = all.get();
  };
  fresh();
  std::barrier next(threads, fresh);
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      fe::thread_idx = {t, 0, 0};
      fe::block_dim = {threads, 1, 1};
      fe::grid_dim = {gx, 1, 1};
      fe::block = &state;
      for (unsigned b = 0; b < gx; ++b) {
        fe::block_idx = {b, 0, 0};
        body();
        warps[t / 32]->arrive_and_drop();
        all->arrive_and_drop();
        next.arrive_and_wait();
      }
    });
  }
  for (auto& th : pool) th.join();
}

// decode_gemv.cu's launch_nt, launch_variant and launch, with the host launcher above.
template <int NT, int MODE, int VARIANT>
void run_nt(const ft::GemvArgs& a) {
  constexpr ft::GemvKnobs k = ft::kGemvVariants[VARIANT];
  using C = ft::Knobs<k.threads, k.unroll, k.load, k.pipe>;
  auto grid = static_cast<unsigned>(ft::ceil_div(a.n, C::kThreads / a.group));
  if (MODE != ft::kAddResidual && a.norm != nullptr) {
    constexpr bool norm = MODE != ft::kAddResidual;
    launch(grid, C::kThreads, [&] { ft::gemv_kernel<bf16, NT, MODE, norm, C>(a); });
  } else {
    launch(grid, C::kThreads, [&] { ft::gemv_kernel<bf16, NT, MODE, false, C>(a); });
  }
}

template <int MODE, int VARIANT = 0>
void run(const ft::GemvArgs& a, int variant) {
  if constexpr (VARIANT < ft::kNumGemvVariants) {
    if (variant != VARIANT) return run<MODE, VARIANT + 1>(a, variant);
    if (a.tokens <= 1) return run_nt<1, MODE, VARIANT>(a);
    if (a.tokens <= 2) return run_nt<2, MODE, VARIANT>(a);
    if (a.tokens <= 4) return run_nt<4, MODE, VARIANT>(a);
    run_nt<8, MODE, VARIANT>(a);
  }
}

}  // namespace

// out, x, w, bias (or null), norm (or null): bf16 bit patterns; x rows x_stride apart.
// mode: 0 plain, 1 residual add (out is the residual), 2 SwiGLU (w has 2n rows). Returns 0 on
// a configuration the real entry point rejects (it raises there), else 1.
extern "C" int ft_decode_gemv_emu(void* out, const void* x, const void* w, const void* bias,
                                  const void* norm, long x_stride, int tokens, int n, int k,
                                  int group, int variant, int mode, float eps) {
  if (variant < 0 || variant >= ft::kNumGemvVariants || tokens < 1 || tokens > ft::kMaxTokens ||
      k % 8 != 0 || group > ft::kGemvVariants[variant].threads || group % 32 != 0) {
    return 0;
  }
  ft::GemvArgs a{out, x, w, bias, norm, x_stride, n, tokens, n, k / 8, group, eps,
                 1.f / static_cast<float>(k)};
  if (mode == ft::kPlain) run<ft::kPlain>(a, variant);
  if (mode == ft::kAddResidual) run<ft::kAddResidual>(a, variant);
  if (mode == ft::kSwiGLU) run<ft::kSwiGLU>(a, variant);
  return 1;
}
