// Host run of the GGUF MoE experts kernels (kernels/include/freetoken/moe_gguf_kernels.cuh) on
// CPU threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: the real kernel
// bodies (alignment, GEMV and tiled paths, combine) in the launch order of moe_gguf.cu's
// run_experts, checked by tests/kernel/test_moe_gguf_emulated.py against a float64 reference.
// Tensor cores are not emulated: the tiled path takes its HIP (CUDA-core) tile.
#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)
#include "freetoken/moe_gguf_kernels.cuh"

namespace fe = freetoken::emu;
using freetoken::bf16;
using freetoken::gguf::kQ4_0;
using freetoken::gguf::kQ4_1;
using freetoken::gguf::kQ5_0;
using freetoken::gguf::kQ5_1;
using freetoken::gguf::kQ4_K;
using freetoken::gguf::kQ5_K;
using freetoken::gguf::kQ6_K;
using freetoken::gguf::kQ8_0;
namespace ma = freetoken::moe_align;
namespace mg = freetoken::moe_gguf;

namespace {

using freetoken::emu::launch;

template <typename F>
bool dispatch(int qtype, F f) {
  switch (qtype) {
    case kQ4_0: f(std::integral_constant<int, kQ4_0>()); return true;
    case kQ4_1: f(std::integral_constant<int, kQ4_1>()); return true;
    case kQ5_0: f(std::integral_constant<int, kQ5_0>()); return true;
    case kQ5_1: f(std::integral_constant<int, kQ5_1>()); return true;
    case kQ8_0: f(std::integral_constant<int, kQ8_0>()); return true;
    case kQ4_K: f(std::integral_constant<int, kQ4_K>()); return true;
    case kQ5_K: f(std::integral_constant<int, kQ5_K>()); return true;
    case kQ6_K: f(std::integral_constant<int, kQ6_K>()); return true;
    default: return false;
  }
}

// moe_gguf.cu's run_experts, launch for launch.
bool run(const mg::QArgs& a, const ma::Plan& plan, int q13, int q2) {
  int64_t want = plan.pairs > a.experts ? plan.pairs : a.experts;
  unsigned align_threads = static_cast<unsigned>(
      want < ma::kAlignThreads ? freetoken::ceil_div(want, 32) * 32 : ma::kAlignThreads);
  launch(1, 1, align_threads, [&] {
    ma::align_kernel(a.tt, const_cast<int*>(a.sorted), a.topk_ids, a.expert_map,
                     static_cast<int>(plan.pairs), a.experts, a.slots, plan.tile_m,
                     static_cast<int>(plan.max_tiles));
  });
  const unsigned tiles = static_cast<unsigned>(plan.max_tiles);
  if (plan.gemv) {
    unsigned gy = static_cast<unsigned>(freetoken::ceil_div(a.inter, mg::kGemvWarps));
    bool ok = dispatch(q13, [&](auto qt) {
      launch(tiles, gy, mg::kGemvWarps * 32, [&] { mg::gemv_gate_up_kernel<qt()>(a); });
    });
    unsigned hy = static_cast<unsigned>(freetoken::ceil_div(a.hidden, mg::kGemvWarps));
    return ok && dispatch(q2, [&](auto qt) {
      launch(a.tokens, hy, mg::kGemvWarps * 32, [&] { mg::gemv_down_kernel<qt()>(a); });
    });
  }
  unsigned gy = static_cast<unsigned>(freetoken::ceil_div(a.inter, 64));
  bool ok = dispatch(q13, [&](auto qt) {
    launch(tiles, gy, mg::kThreads, [&] { mg::tile_gate_up_kernel<qt()>(a); });
  });
  for (int64_t c0 = 0; ok && c0 < a.hidden; c0 += a.y_cols) {
    const int64_t cw = a.hidden - c0 < a.y_cols ? a.hidden - c0 : a.y_cols;
    unsigned cy = static_cast<unsigned>(freetoken::ceil_div(cw, 64));
    ok = dispatch(q2, [&](auto qt) {
      launch(tiles, cy, mg::kThreads, [&] { mg::tile_down_kernel<qt()>(a, c0, cw); });
    });
    const int64_t blocks = freetoken::ceil_div(a.tokens * cw, 256);
    launch(static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 1, 256,
           [&] { mg::combine_kernel(a, c0, cw); });
  }
  return ok;
}

}  // namespace

// out[T, H] (bf16 bits) as moe_experts_gguf computes it; 0 for an unknown type.
extern "C" int ft_moe_gguf_emu(uint16_t* out, const uint16_t* x, const uint8_t* w13,
                               const uint8_t* w2, int q13, int q2, const int* ids,
                               const float* weights, const int* expert_map, int T, int K, int E,
                               int S, int H, int I) {
  int bw13, bb13, bw2, bb2;
  freetoken::gguf::block_shape(q13, &bw13, &bb13);
  freetoken::gguf::block_shape(q2, &bw2, &bb2);
  if (bw13 == 0 || bw2 == 0 || H % bw13 || I % bw2) return 0;
  ma::Plan plan = ma::make_plan(T, K, E, I, 2);
  std::vector<unsigned char> ws_bytes(plan.total + 256, 0xFF);  // poisoned, as a fresh buffer
  char* ws = reinterpret_cast<char*>(
      (reinterpret_cast<uintptr_t>(ws_bytes.data()) + 255) / 256 * 256);
  mg::QArgs a;
  a.out = reinterpret_cast<bf16*>(out);
  a.x = reinterpret_cast<const bf16*>(x);
  a.w13 = w13;
  a.w2 = w2;
  a.rb13 = H / bw13 * bb13;
  a.rb2 = I / bw2 * bb2;
  a.topk_ids = ids;
  a.topk_w = weights;
  a.expert_map = expert_map;
  int* sorted = nullptr;
  ma::carve(ws, plan, &a.tt, &sorted, &a.act, &a.y);
  a.sorted = sorted;
  a.tokens = T;
  a.top_k = K;
  a.experts = E;
  a.slots = S;
  a.hidden = H;
  a.inter = I;
  a.y_cols = plan.y_cols;
  return run(a, plan, q13, q2) ? 1 : 0;
}
