// Host run of the small-step MoE decode kernels (kernels/include/freetoken/moe_decode_kernels.cuh)
// on CPU threads through the stand-in tests/kernel/emu/freetoken/cuda_common.cuh, launched as
// moe_decode.cu launches them; checked by tests/kernel/test_moe_decode_emulated.py.
#include "emu_launch.h"  // the host stand-in (tests/kernel/emu first on the path)
#include "freetoken/moe_decode_kernels.cuh"

namespace fe = freetoken::emu;
namespace md = freetoken::moe_decode;
using freetoken::bf16;

namespace {

using freetoken::emu::launch;

// Kind 1's gate/up runs as a grid of kEmuSms SMs' worth of blocks, so that its warps take
// several items each, as on a GPU with fewer SMs than the step has row tiles.
constexpr int kEmuSms = 2;

template <int NT, int V>
void gate_up(const md::DecodeArgs& a) {
  constexpr md::Variant k = md::kVariants[V];
  if constexpr (k.kind == 1) {
    unsigned blocks = static_cast<unsigned>(md::gate_up_stream_blocks(a, kEmuSms, k.min_blocks));
    launch(blocks, 1, md::kThreads,
           [&] { md::gate_up_stream_kernel<bf16, NT, k.unroll, k.min_blocks>(a); });
  } else {
    unsigned blocks = static_cast<unsigned>(md::gate_up_blocks(a, k.rows));
    launch(blocks, 1, md::kThreads,
           [&] { md::gate_up_kernel<bf16, NT, k.rows, k.unroll, k.min_blocks>(a); });
  }
}

template <int V>
void down(const md::DecodeArgs& a) {
  constexpr md::Variant k = md::kVariants[V];
  unsigned tokens = static_cast<unsigned>(a.tokens);
  if constexpr (k.kind == 1) {
    launch(tokens, static_cast<unsigned>(freetoken::ceil_div(a.hidden, k.rows)), md::kThreads,
           [&] { md::down_stream_kernel<bf16, k.rows, k.units, k.vecs, k.down_blocks>(a); });
  } else {
    launch(tokens, static_cast<unsigned>(freetoken::ceil_div(a.hidden, md::kRows * k.rows)),
           md::kThreads, [&] { md::down_kernel<bf16, k.rows, k.unroll, k.min_blocks>(a); });
  }
}

// Both launches of variant V, as moe_decode.cu's dispatch (variants 1..: up to 2 tokens).
template <int V>
void decode(const md::DecodeArgs& a) {
  if (a.tokens <= 1) {
    gate_up<1, V>(a);
  } else if (a.tokens <= 2) {
    gate_up<2, V>(a);
  } else if (a.tokens <= 4) {
    gate_up<4, 0>(a);
  } else {
    gate_up<8, 0>(a);
  }
  md::DecodeArgs d = a;
  if (a.sh_gate_w != nullptr) d.sh_gate_w = a.sh_gate;  // as moe_decode.cu's down: "gated"
  d.sh_w13 = nullptr;
  down<V>(d);
}

template <int V = md::kNumVariants - 1>
void decode_variant(const md::DecodeArgs& a, int variant) {
  if constexpr (V > 0) {
    if (variant == V) return decode<V>(a);
    decode_variant<V - 1>(a, variant);
  } else {
    decode<0>(a);
  }
}

}  // namespace

// moe_decode.cu's two launches (launch shape `variant`) over bf16 bits. Shared expert when sh_w13 != null (sh_gate_w
// may be null); act_ws holds T*K*I activations; out is overwritten or added to (accumulate).
extern "C" void ft_moe_decode_emu(uint16_t* out, const uint16_t* x, const uint16_t* w13,
                                  const uint16_t* w2, const int* ids, const float* weights,
                                  const int* expert_map, uint16_t* act_ws,
                                  const uint16_t* sh_w13, const uint16_t* sh_w2,
                                  uint16_t* sh_act, const uint16_t* sh_gate_w,
                                  uint16_t* sh_gate, int T, int K, int E, int S, int H, int I,
                                  int Is, int accumulate, int variant) {
  md::DecodeArgs a{};
  a.out = out;
  a.x = x;
  a.w13 = w13;
  a.w2 = w2;
  a.topk_ids = ids;
  a.topk_w = weights;
  a.expert_map = expert_map;
  a.act = act_ws;
  a.sh_w13 = sh_w13;
  a.sh_w2 = sh_w2;
  a.sh_act = sh_act;
  a.sh_gate_w = sh_gate_w;
  a.sh_gate = sh_gate;
  a.x_stride = H;
  a.out_stride = H;
  a.sh_act_stride = Is;
  a.sh_gate_stride = 1;
  a.tokens = T;
  a.top_k = K;
  a.experts = E;
  a.slots = S;
  a.hidden = H;
  a.inter = I;
  a.sh_inter = Is;
  a.accumulate = accumulate != 0;
  decode_variant(a, variant);
}
