// Host run of the int8-activation decode GEMV and the MoE decode halves
// (freetoken/gguf_gemv_q8_kernels.cuh, the kernels of kernels/cuda/gguf_gemv_q8.cu) on CPU
// threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh: every type,
// rows-per-warp and token instantiation, mode and the norm prologue, and the gathered expert
// rows, launched through the kernel's own dispatch; checked by
// tests/kernel/test_gguf_gemv_q8_emulated.py. dp4a runs as 4 byte products (the HIP form).
#include <cmath>

#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)

inline float rsqrtf(float v) { return 1.f / std::sqrt(v); }

#include "freetoken/gguf_gemv_q8_kernels.cuh"

namespace q8 = freetoken::gemv_q8;
using freetoken::bf16;
using freetoken::emu::launch;

namespace {

// One "SM": the grid's x extent shrinks to a few blocks, so each block walks several row
// groups (the launch's one-wave rule at its smallest).
template <int MODE, int GATHER = q8::kDense>
bool run_mode(const q8::Args& args, int qtype, int rows, unsigned grid_y = 1) {
  q8::Args a = args;
  a.grid_y = static_cast<int>(grid_y);
  a.sms = 1;
  return q8::dispatch<MODE, GATHER>(a, qtype, rows, [&](auto kernel, unsigned blocks,
                                                        int threads) {
    launch(blocks, grid_y, static_cast<unsigned>(threads), [&] { kernel(a); });
  });
}

// The GPU's row pitch of `weights` weights of qtype: whole blocks padded to 16-byte words.
bool block_rows(int qtype, long weights, int* row_bytes) {
  int per_block = 0, block_bytes = 0;
  freetoken::gguf::block_shape(qtype, &per_block, &block_bytes);
  if (per_block == 0 || weights % per_block != 0) return false;
  *row_bytes = static_cast<int>((weights / per_block * block_bytes + 15) / 16 * 16);
  return true;
}

}  // namespace

// out (bf16 or f32 bits), x, bias (or null), norm (or null): bf16 bit patterns; x rows ldx
// apart, out rows ldo apart; w: rows of qtype blocks padded to 16 bytes (2n of them for mode 2). Returns 0 for
// what the real entry point refuses (it raises there), else 1.
extern "C" int ft_gguf_gemv_q8_emu(void* out, int out_f32, const void* x, const void* w,
                                   const void* bias, const void* norm, long ldx, long ldo,
                                   int tokens, long n, long k, int qtype, int mode, int rows,
                                   float eps) {
  int rb = 0;
  if (!block_rows(qtype, k, &rb) || tokens < 1 || tokens > q8::max_tokens(qtype) ||
      tokens * k > q8::capacity(qtype) || (out_f32 && mode != q8::kStore) || rows < 0 ||
      rows > 2 || ldx % 8 != 0) {
    return 0;
  }
  q8::Args a{out, static_cast<const bf16*>(x), static_cast<const uint8_t*>(w),
             static_cast<const bf16*>(bias), static_cast<const bf16*>(norm), n, k, rb, ldx,
             ldo, tokens, out_f32 != 0, eps};
  if (mode == q8::kStore) return run_mode<q8::kStore>(a, qtype, rows);
  if (mode == q8::kAddResidual) return run_mode<q8::kAddResidual>(a, qtype, rows);
  if (mode == q8::kSwiGLU) return run_mode<q8::kSwiGLU>(a, qtype, rows);
  return 0;
}

// The MoE halves (the entry points moe_q8_gate_up and moe_q8_down without their checks):
// x bf16 [tokens, h]; ids int32 [tokens, top_k]; map int32 [experts]; w13 [slots, 2i, rb13];
// w2 [slots, h, rb2]; act bf16 [tokens * top_k, i]; out bf16 [tokens, ldo]. slot13 / slot2:
// the bytes from one slot to the next (0: one matrix, packed), as an offload pool lays them out.
// Returns 0 for what the real entry points refuse.
extern "C" int ft_moe_q8_emu(void* out, void* act, const void* x, const void* w13,
                             const void* w2, const int* ids, const float* weights,
                             const int* map, int tokens, int top_k, int experts, int slots,
                             long h, long i, long ldo, int qtype13, int qtype2, int accumulate,
                             int rows, long slot13, long slot2) {
  int rb13 = 0, rb2 = 0;
  if (!block_rows(qtype13, h, &rb13) || !block_rows(qtype2, i, &rb2) || tokens < 1 ||
      tokens > q8::kMaxMoETokens || top_k < 1 || top_k > q8::kMaxTopK ||
      h > q8::capacity(qtype13) || top_k * i > q8::capacity(qtype2) ||
      (qtype2 == freetoken::gguf::kQ4_K && i % q8::kBlockWeights != 0) || rows < 0 ||
      rows > 2) {
    return 0;
  }
  q8::Args g{};
  g.out = act;
  g.x = static_cast<const bf16*>(x);
  g.w = static_cast<const uint8_t*>(w13);
  g.n = i;
  g.k = h;
  g.row_bytes = rb13;
  g.ldx = h;
  g.ldo = i;
  g.tokens = 1;
  g.gather = q8::kExpertGateUp;
  g.topk_ids = ids;
  g.expert_map = map;
  g.top_k = top_k;
  g.experts = experts;
  g.slots = slots;
  g.expert_bytes = slot13 ? slot13 : 2 * i * rb13;
  if (!run_mode<q8::kSwiGLU, q8::kExpertGateUp>(g, qtype13, rows, tokens * top_k)) return 0;
  q8::Args d = g;
  d.out = out;
  d.x = static_cast<const bf16*>(act);
  d.w = static_cast<const uint8_t*>(w2);
  d.n = h;
  d.k = top_k * i;
  d.row_bytes = rb2;
  d.ldx = d.k;
  d.ldo = ldo;
  d.gather = q8::kExpertDown;
  d.topk_w = weights;
  d.expert_bytes = slot2 ? slot2 : h * rb2;
  d.seg = i;
  return accumulate ? run_mode<q8::kAddResidual, q8::kExpertDown>(d, qtype2, rows, tokens)
                    : run_mode<q8::kStore, q8::kExpertDown>(d, qtype2, rows, tokens);
}
