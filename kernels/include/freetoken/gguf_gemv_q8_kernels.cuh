// The device half of gguf_gemv_q8 (kernels/cuda/gguf_gemv_q8.cu holds the launches and checks):
// the decode GEMV (1-8 tokens) over GGUF rows on int8 activations, with the fused decode step's
// prologue and epilogues, and the two halves of the MoE decode step over GGUF experts, which are
// the same kernels reading gathered rows. Q4_K rows stream straight into registers (below);
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K rows, whose blocks are not all 16-byte aligned,
// are staged
// through shared memory as gguf_gemv stages them (freetoken/gguf_stage.cuh) and summed by
// gguf::dot32_q8. Kept apart from the host code so tests/kernel/gguf_gemv_q8_emu.cc runs these
// very bodies on CPU threads.
//
// Why int8 activations: gguf_gemv (quant_gemv.cu) turns every 4-bit weight into a float and
// multiplies it by a float x, about 3 instructions per weight and token; at the rate HBM
// delivers Q4_K weights (5+ G weights/s per SM on an H200) that work, not the memory, sets its
// speed (57% of read bandwidth). Here each block first quantizes x (optionally RMS-normed, as
// decode_gemv's prologue) to int8 in 32-value groups with one f32 scale each, into shared
// memory; the weights' nibbles then meet x in 4-way int8 dot products (dp4a), and the block
// scales are applied once per 32 weights: under 2 instructions per weight.
//
// Layout a lane reads: a Q4_K block is 144 bytes = 9 16-byte words, the first holding
// (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins) and word 1 + j holding weights
// 16h..16h+15 of sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles), j = 2c + h. A warp's 32
// lanes take 4 consecutive blocks, lane & 7 = j: every load is one 16-byte word and the warp's
// loads cover 576 contiguous bytes (the header word read by 8 lanes at once).
//
// Numerics: x is quantized per 32 values, q = rint(x * 127 / amax), d = amax / 127; the sum of
// sub-block s is d_w * sc_s * d_x * sum(q_w q_x) - dmin * m_s * d_x * sum(q_x) (the min term
// counted once, by the lane with h = 0). Against the bf16 product this adds the int8 rounding
// of x (relative 1/254 of each group's largest value), as llama.cpp's quantized GEMV does.
//
// MoE decode (Args::gather), ids and weights staying on the device (graph-capturable):
//  kExpertGateUp  block row (pair p = t * K + k): act[p] = silu(gate_s . x_t) * (up_s . x_t),
//                 w13 of slot s = expert_map[topk_ids[p]] (the SwiGLU mode on that expert's
//                 [2I, K] rows); a pair without a slot writes zeros.
//  kExpertDown    block row (token t): y_t = sum_k w_k * (down_{s_k} . act[t * K + k]) as ONE
//                 dot product over the K * I values of the token's activations, which lie
//                 together in act: row h of that virtual [H, K * I] matrix is row h of each
//                 routed expert's down matrix in turn. The routing weight w_k multiplies the
//                 scales of segment k's x groups (exact: an int8 group scaled by w_k has the
//                 same quants and w_k times the scale); an unmapped pair reads slot 0 at
//                 weight 0. Stored, or added to the residual stream (kAddResidual).
#pragma once

#include <type_traits>

#include "freetoken/gemv_knobs.cuh"
#include "freetoken/gemv_prologue.cuh"
#include "freetoken/gguf_blocks.h"
#include "freetoken/gguf_stage.cuh"

namespace freetoken {
namespace gemv_q8 {

constexpr int kWarps = 8, kThreads = kWarps * kWarp;
// Tokens one call takes: 1, 2, 4 or 8 a kernel (3 runs the 4-token one with a token masked).
// The types a 4-bit K-quant or Q6_K / Q8_0 file keeps most of its bytes in take up to 8, so a
// batch of 8 reads each weight once; the rest take up to kMaxTokensOther.
constexpr int kMaxTokens = 8, kMaxTokensOther = 2;
constexpr int kXCapacity = 32768;  // int8 x values a block stages: tokens * K at most
// The staged kernel: 4 warps, one output row each (two weight rows for SwiGLU), and room for
// x beside the weight chunks within 48 KB of shared memory.
constexpr int kStagedWarps = 4, kStagedThreads = kStagedWarps * kWarp;
constexpr int kStagedCapacity = 24576;
constexpr int kUnroll = 4;         // 16-byte weight words in flight per lane and row
// Q4_K rows of at most kShortUnits units (K <= 2048) fill only 2 of those 4 words a lane: their
// kernel holds 2, which halves the registers the loads take and fits 2 blocks on an SM where
// the SwiGLU pair's 4-word kernel fit one (172 registers a thread).
constexpr int kShortUnroll = 2, kShortUnits = kShortUnroll * kWarp;
constexpr int kBlockBytes = 144, kBlockWeights = 256;  // Q4_K
constexpr int kUnitsPerBlock = 8;  // lanes (16-byte words of nibbles) per Q4_K block
constexpr int kMaxTopK = 16;       // routed experts per token the MoE halves take
// tokens per MoE call: a block row per routed pair (gate/up) or token (down), each of one token
constexpr int kMaxMoETokens = 4096;

enum Mode : int { kStore = 0, kAddResidual = 1, kSwiGLU = 2 };
enum Gather : int { kDense = 0, kExpertGateUp = 1, kExpertDown = 2 };

struct Args {
  void* out;           // [T, ldo]: bf16; f32 allowed for kStore (out_f32)
  const bf16* x;       // [T, ldx]
  const uint8_t* w;    // [N, row_bytes] GGUF rows (kSwiGLU: [2N, ...], gate rows then up rows)
  const bf16* bias;    // [N] or null (kStore only)
  const bf16* norm;    // [K] RMSNorm weight, or null for x as it is
  int64_t n, k, row_bytes, ldx, ldo;
  int tokens;          // 1..NT, the kernel's tokens (the MoE halves: 1 per block)
  bool out_f32;
  float eps;
  // MoE decode (gather != kDense): w holds S experts' matrices expert_bytes apart
  int gather = kDense;
  const int* topk_ids = nullptr;    // [T, top_k]
  const float* topk_w = nullptr;    // [T, top_k] (kExpertDown)
  const int* expert_map = nullptr;  // [experts] -> slot, or < 0
  int top_k = 1, experts = 0, slots = 0;
  int64_t expert_bytes = 0;
  int64_t seg = 0;                  // kExpertDown: weights per expert row (I); k = top_k * seg
  // The launch: the grid's y extent (1, pairs or tokens) and the SMs its x extent is sized
  // for (0: one block per row group; see kResident)
  int grid_y = 1, sms = 0;
};

// Where the row groups outnumber them, a launch keeps about one wave of blocks (x times y):
// what an SM holds of each kernel (2 of the Q4_K kernel's 256-thread blocks, their registers'
// limit; 4 of the staged kernel's 128-thread ones) times the SMs. Each block then stages x
// once and streams several row groups, where a block per group re-quantized x for every 8 or
// 4 rows (at 8 tokens and a 152k-row head, re-reading x cost more than the weights).
constexpr int kResidentQ4k = 2, kResidentStaged = 4;

using Word = Vec<uint32_t, 4>;

using gguf::dot4_i8;

__device__ __forceinline__ int round_to_int(float v) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(v);
#else
  return static_cast<int>(rintf(v));
#endif
}

/*! \brief The slot of pair p's expert, or -1 (an id out of range, or not mapped). */
__device__ __forceinline__ int expert_slot(const Args& a, int64_t p) {
  const int e = a.topk_ids[p];
  if (e < 0 || e >= a.experts) return -1;
  const int s = a.expert_map[e];
  return s >= 0 && s < a.slots ? s : -1;
}

// What one block reads and writes: the dense product's operands, or a MoE half's gathered ones.
struct View {
  const bf16* x;
  const uint8_t* w;     // the row set of this block (dense, gate/up: [N or 2N, row_bytes])
  int64_t out_row;      // offset of the block's output row 0 in out, in elements
  bool skip;            // a gate/up pair without a slot: its act row is zeroed
};

/*! \brief The block's view; kExpertDown also fills seg_w[k] (expert k's matrix; slot 0 when
 * unmapped) and seg_scale[k] (its routing weight, 0 when unmapped). */
template <int GATHER>
__device__ __forceinline__ View block_view(const Args& a, const uint8_t** seg_w,
                                           float* seg_scale) {
  if constexpr (GATHER == kExpertGateUp) {
    const int64_t p = blockIdx.y;
    const int slot = expert_slot(a, p);
    return {a.x + (p / a.top_k) * a.ldx, a.w + (slot < 0 ? 0 : slot) * a.expert_bytes,
            p * a.ldo, slot < 0};
  } else if constexpr (GATHER == kExpertDown) {
    const int64_t t = blockIdx.y;
    const int k = static_cast<int>(threadIdx.x);
    if (k < a.top_k) {
      const int slot = expert_slot(a, t * a.top_k + k);
      seg_w[k] = a.w + (slot < 0 ? 0 : slot) * a.expert_bytes;
      seg_scale[k] = slot < 0 ? 0.f : a.topk_w[t * a.top_k + k];
    }
    __syncthreads();
    return {a.x + t * a.k, a.w, t * a.ldo, false};
  } else {
    return {a.x, a.w, 0, false};
  }
}

// x of the block's NT tokens as int8 groups of 32 in shared memory: xq[t * K + i], and per
// group (d, d * sum(q)) at xds[2 * (t * K / 32 + g)]; RMS-normed first when a.norm is set
// (rounded to bf16 where the unfused rms_norm stores it). seg_scale (kExpertDown) multiplies
// the scales of each expert segment's groups by its routing weight.
template <int NT, int THREADS>
__device__ void stage_x(const Args& a, const bf16* x, int8_t* xq, float* xds,
                        const float* seg_scale = nullptr) {
  __shared__ float inv_rms[NT];
  if (a.norm != nullptr) {
    block_inv_rms<bf16, NT, THREADS>(x, a.ldx, a.k, a.tokens, a.eps, inv_rms);
  }
  const int64_t groups = a.k / 32;
  for (int64_t gi = threadIdx.x; gi < a.tokens * groups; gi += THREADS) {
    const int t = static_cast<int>(gi / groups);
    const int64_t g = gi % groups;
    const bf16* xp = x + t * a.ldx + 32 * g;
    float v[32], amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Vec<bf16, 8> xv = load_vec<bf16, 8>(xp + 8 * i);
      Vec<bf16, 8> nv;
      if (a.norm != nullptr) nv = load_vec<bf16, 8>(a.norm + 32 * g + 8 * i);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        float f = to_float(xv.v[e]);
        if (a.norm != nullptr) f = to_float(from_float<bf16>(f * inv_rms[t] * to_float(nv.v[e])));
        v[8 * i + e] = f;
        amax = fmaxf(amax, fabsf(f));
      }
    }
    const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    Word lo, hi;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      uint32_t word = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = round_to_int(v[4 * j + e] * id);
        sum += q;
        word |= (static_cast<uint32_t>(q) & 0xFFu) << (8 * e);
      }
      if (j < 4) {
        lo.v[j] = word;
      } else {
        hi.v[j - 4] = word;
      }
    }
    uint32_t* dst = reinterpret_cast<uint32_t*>(xq + t * a.k + 32 * g);
    store_vec<uint32_t, 4>(dst, lo);
    store_vec<uint32_t, 4>(dst + 4, hi);
    const float s = seg_scale != nullptr ? seg_scale[32 * g / a.seg] : 1.f;
    xds[2 * (t * groups + g)] = d * s;
    xds[2 * (t * groups + g) + 1] = d * s * static_cast<float>(sum);
  }
  __syncthreads();
}

/*! \brief Byte i (0..11, a compile-time or per-lane value) of the 12 scale bytes in header
 * words 1..3, by shifts and selects (a dynamic index into a register array would spill). */
__device__ __forceinline__ uint32_t scale_byte(const Word& hdr, int i) {
  const uint32_t word = i < 4 ? hdr.v[1] : i < 8 ? hdr.v[2] : hdr.v[3];
  return (word >> (8 * (i & 3))) & 0xFFu;
}

/*! \brief gguf::scale_min_k4 on the header word in registers. */
__device__ __forceinline__ void scale_min(const Word& hdr, int s, float* sc, float* mn) {
  uint32_t a, b;
  if (s < 4) {
    a = scale_byte(hdr, s) & 63u;
    b = scale_byte(hdr, s + 4) & 63u;
  } else {
    a = (scale_byte(hdr, s + 4) & 0xFu) | ((scale_byte(hdr, s - 4) >> 6) << 4);
    b = (scale_byte(hdr, s + 4) >> 4) | ((scale_byte(hdr, s) >> 6) << 4);
  }
  *sc = static_cast<float>(a);
  *mn = static_cast<float>(b);
}

// Where unit u (one 16-byte word of nibbles) of weight row r lives: the start of its Q4_K
// block. Dense and gate/up rows are whole rows of one matrix; kExpertDown's virtual row h walks
// the routed experts' rows h, `units_per_seg` units each.
template <int GATHER, int NW>
struct Q4kRows {
  const uint8_t* base;          // dense, gate/up: the rows' matrix
  const uint8_t* const* seg_w;  // kExpertDown: each routed expert's matrix
  int64_t off[NW];              // byte offset of weight row r in its matrix
  int units_per_seg;

  __device__ __forceinline__ const uint8_t* block(int r, int u) const {
    if constexpr (GATHER == kExpertDown) {
      const int s = u / units_per_seg, v = u - s * units_per_seg;
      return seg_w[s] + off[r] + static_cast<int64_t>(v / kUnitsPerBlock) * kBlockBytes;
    } else {
      return base + off[r] + static_cast<int64_t>(u / kUnitsPerBlock) * kBlockBytes;
    }
  }
};

// The lane's words of units u0 + i * 32 + lane (i < KU) of every row it reads.
template <int GATHER, int NW, int KU>
__device__ __forceinline__ void load_units(const Q4kRows<GATHER, NW>& rows, int u0, int units,
                                           int lane, Word (&hdr)[KU][NW], Word (&qs)[KU][NW]) {
#pragma unroll
  for (int i = 0; i < KU; ++i) {
    const int u = u0 + i * kWarp + lane;
    if (u >= units) break;
    const int j = u % kUnitsPerBlock;
#pragma unroll
    for (int r = 0; r < NW; ++r) {
      const uint8_t* blk = rows.block(r, u);
      hdr[i][r] = load_weight<kLoadNoL1, uint32_t, 4>(reinterpret_cast<const uint32_t*>(blk));
      qs[i][r] = load_weight<kLoadNoL1, uint32_t, 4>(
          reinterpret_cast<const uint32_t*>(blk + 16 + 16 * j));
    }
  }
}

// The warp's sums of its R output rows reduced and stored through the mode's epilogue (lane 0).
template <int R, int MODE, int NW, int NT>
__device__ __forceinline__ void finish(const Args& a, float (&acc)[NW][NT], int64_t n0,
                                       int64_t out_row, int lane) {
  static_assert(NW == (MODE == kSwiGLU ? 2 * R : R), "SwiGLU reads R gate and R up rows");
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = warp_sum(acc[r][t]);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t n = n0 + r;
    if (n >= a.n) break;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= a.tokens) break;
      const float v = acc[r][t];
      const int64_t at = out_row + t * a.ldo + n;
      if (MODE == kStore) {
        const float b = a.bias != nullptr ? to_float(a.bias[n]) : 0.f;
        if (a.out_f32) {
          static_cast<float*>(a.out)[at] = v + b;
        } else {
          static_cast<bf16*>(a.out)[at] = from_float<bf16>(v + b);
        }
      } else if (MODE == kAddResidual) {
        bf16* o = static_cast<bf16*>(a.out) + at;
        *o = from_float<bf16>(to_float(*o) + to_float(from_float<bf16>(v)));
      } else {
        // gate and up rounded where the unfused chain stores them, as decode_gemv_swiglu
        const float g = to_float(from_float<bf16>(v));
        const float u = to_float(from_float<bf16>(acc[R + r][t]));
        static_cast<bf16*>(a.out)[at] = from_float<bf16>(g / (1.f + __expf(-g)) * u);
      }
    }
  }
}

/*! \brief A gate/up pair without a slot: the warp's act rows are zeros (lane 0 writes). */
template <int R>
__device__ __forceinline__ void zero_rows(const Args& a, int64_t n0, int64_t out_row, int lane) {
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (n0 + r < a.n) static_cast<bf16*>(a.out)[out_row + n0 + r] = from_float<bf16>(0.f);
}

// out[t, n] for the warp's R output rows n (kSwiGLU: R gate rows and their R up rows), KU
// words in flight per lane and row.
template <int R, int NT, int MODE, int GATHER = kDense, int KU = kUnroll>
__global__ void __launch_bounds__(kThreads, KU == kShortUnroll ? 2 : 1) q4k_gemv_kernel(Args a) {
  __shared__ __attribute__((aligned(16))) int8_t xq[kXCapacity];
  __shared__ __attribute__((aligned(16))) float xds[kXCapacity / 16];
  __shared__ const uint8_t* seg_w[kMaxTopK];
  __shared__ float seg_scale[kMaxTopK];
  constexpr int NW = MODE == kSwiGLU ? 2 * R : R;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // Rows n0, n0 + step, ...: a grid smaller than the rows (Args::grid_rows) stages x once per
  // block and streams several row groups through it.
  const int64_t step = static_cast<int64_t>(gridDim.x) * kWarps * R;
  int64_t n0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * R;
  const int units = static_cast<int>(a.k / kBlockWeights * kUnitsPerBlock);
  Word hdr[KU][NW], qs[KU][NW];
  // The dense product's first weights stream in while the previous kernel drains
  // (programmatic launch) and while x is staged; x itself is read only after
  // wait_for_inputs(). The MoE halves read ids the previous kernels wrote: kExpertDown's come
  // from the routing kernel that gate/up waited for before letting it start, so its weights
  // stream early too; gate/up waits first.
  if constexpr (GATHER == kExpertGateUp) wait_for_inputs();
  const View view = block_view<GATHER>(a, seg_w, seg_scale);
  Q4kRows<GATHER, NW> rows;
  rows.base = view.w;
  rows.seg_w = seg_w;
  rows.units_per_seg = static_cast<int>(a.seg / kBlockWeights * kUnitsPerBlock);
  auto row_group = [&](int64_t first) {
#pragma unroll
    for (int r = 0; r < NW; ++r) {
      int64_t row = first + r % R;
      row = row < a.n ? row : a.n - 1;  // rows past N repeat the last (their sums are dropped)
      rows.off[r] = (row + (r >= R ? a.n : 0)) * a.row_bytes;
    }
  };
  row_group(n0);
  if (n0 < a.n && !view.skip) load_units<GATHER, NW, KU>(rows, 0, units, lane, hdr, qs);
  if constexpr (GATHER != kExpertGateUp) wait_for_inputs();
  if (view.skip) {  // uniform over the block
    allow_dependents();
    if constexpr (GATHER == kExpertGateUp)
      for (; n0 < a.n; n0 += step) zero_rows<R>(a, n0, view.out_row, lane);
    return;
  }
  stage_x<NT, kThreads>(a, view.x, xq, xds, GATHER == kExpertDown ? seg_scale : nullptr);
  // this lane's place in every block it reads: word j = 2c + h (see the file comment)
  const int j = lane % kUnitsPerBlock, c = j >> 1, h = j & 1;
  const int64_t groups = a.k / 32;
  // whole warps from here: nothing below synchronises the block
  for (bool first = true; n0 < a.n; n0 += step, first = false) {
    if (!first) {
      row_group(n0);
      load_units<GATHER, NW, KU>(rows, 0, units, lane, hdr, qs);
    }
    float acc[NW][NT] = {};
    for (int u0 = 0; u0 < units; u0 += kWarp * KU) {
      if (u0 > 0) load_units<GATHER, NW, KU>(rows, u0, units, lane, hdr, qs);
#pragma unroll
      for (int i = 0; i < KU; ++i) {
        const int u = u0 + i * kWarp + lane;
        if (u >= units) break;
        const int64_t blk = u / kUnitsPerBlock;
        float f0[NW], f1[NW], m[NW][2];
#pragma unroll
        for (int r = 0; r < NW; ++r) {
          const float d = gguf::half_bits_to_float(hdr[i][r].v[0] & 0xFFFFu);
          const float dmin = gguf::half_bits_to_float(hdr[i][r].v[0] >> 16);
          float sc0, mn0, sc1, mn1;
          scale_min(hdr[i][r], 2 * c, &sc0, &mn0);
          scale_min(hdr[i][r], 2 * c + 1, &sc1, &mn1);
          f0[r] = d * sc0;
          f1[r] = d * sc1;
          m[r][0] = h == 0 ? dmin * mn0 : 0.f;  // each sub-block's min term counted once
          m[r][1] = h == 0 ? dmin * mn1 : 0.f;
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t >= a.tokens) break;
          const int8_t* xp = xq + t * a.k + blk * kBlockWeights + 64 * c + 16 * h;
          const Word x0 = load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(xp));
          const Word x1 = load_vec<uint32_t, 4>(reinterpret_cast<const uint32_t*>(xp + 32));
          // (d, d * sum q) of sub-blocks 2c and 2c + 1: 4 floats, 16-byte aligned (2c even)
          const Vec<float, 4> ds =
              load_vec<float, 4>(xds + 2 * (t * groups + blk * 8 + 2 * c));
#pragma unroll
          for (int r = 0; r < NW; ++r) {
            int p0 = 0, p1 = 0;
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const uint32_t wv = qs[i][r].v[e];
              p0 = dot4_i8(wv & 0x0F0F0F0Fu, x0.v[e], p0);
              p1 = dot4_i8((wv >> 4) & 0x0F0F0F0Fu, x1.v[e], p1);
            }
            acc[r][t] += f0[r] * ds.v[0] * static_cast<float>(p0) +
                         f1[r] * ds.v[2] * static_cast<float>(p1) -
                         (m[r][0] * ds.v[1] + m[r][1] * ds.v[3]);
          }
        }
      }
    }
    if (n0 + step >= a.n) allow_dependents();  // the warp's last row group
    finish<R, MODE>(a, acc, n0, view.out_row, lane);
  }
}

// out[t, n] for the warp's one output row n (kSwiGLU: its gate and up rows) over blocks of QT,
// staged through shared memory a chunk of whole blocks at a time (gguf_gemv's staging); lanes
// take the chunk's 32-weight units in turn, each meeting its x group in dot32_q8. kExpertDown
// walks the routed experts' rows n one after another, segment s meeting x from s * seg on.
template <int QT, int NT, int MODE, int GATHER = kDense>
__global__ void __launch_bounds__(kStagedThreads) staged_gemv_kernel(Args a) {
  using B = gguf::Block<QT>;
  constexpr int NW = MODE == kSwiGLU ? 2 : 1;
  using Stage = gguf_stage::GgufStage<QT, NW>;
  __shared__ __attribute__((aligned(16))) int8_t xq[kStagedCapacity];
  __shared__ __attribute__((aligned(16))) float xds[kStagedCapacity / 16];
  __shared__ __attribute__((aligned(16))) uint8_t staged[kStagedWarps][NW * Stage::kChunk];
  __shared__ const uint8_t* seg_w[kMaxTopK];
  __shared__ float seg_scale[kMaxTopK];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  // rows n0, n0 + step, ... (a grid smaller than the rows: Args::grid_rows)
  const int64_t step = static_cast<int64_t>(gridDim.x) * kStagedWarps;
  int64_t n0 = static_cast<int64_t>(blockIdx.x) * kStagedWarps + warp;
  if constexpr (GATHER == kExpertGateUp) wait_for_inputs();
  const View view = block_view<GATHER>(a, seg_w, seg_scale);
  const uint8_t* rows[NW];
  int64_t row = 0;
  auto set_row = [&](int64_t n) {
    row = n < a.n ? n : a.n - 1;
#pragma unroll
    for (int r = 0; r < NW; ++r) rows[r] = view.w + (row + (r > 0 ? a.n : 0)) * a.row_bytes;
    if constexpr (GATHER == kExpertDown) rows[0] = seg_w[0] + row * a.row_bytes;
  };
  set_row(n0);
  Stage stage;
  const int bytes = static_cast<int>(a.row_bytes < Stage::kChunk ? a.row_bytes : Stage::kChunk);
  if (n0 < a.n && !view.skip) stage.load(rows, 0, bytes, lane);  // in flight while x is staged
  if constexpr (GATHER != kExpertGateUp) wait_for_inputs();
  if (view.skip) {  // uniform over the block
    allow_dependents();
    if constexpr (GATHER == kExpertGateUp)
      for (; n0 < a.n; n0 += step) zero_rows<1>(a, n0, view.out_row, lane);
    return;
  }
  stage_x<NT, kStagedThreads>(a, view.x, xq, xds, GATHER == kExpertDown ? seg_scale : nullptr);
  const int64_t groups = a.k / 32;
  uint8_t* mine = staged[warp];
  const int segments = GATHER == kExpertDown ? a.top_k : 1;
  // whole warps from here: below, only the warp synchronises
  for (bool first = true; n0 < a.n; n0 += step, first = false) {
    if (!first) {
      set_row(n0);
      stage.load(rows, 0, bytes, lane);
    }
    float acc[NW][NT] = {};
    for (int s = 0; s < segments; ++s) {
      if (s > 0) {  // kExpertDown: the next expert's row
        rows[0] = seg_w[s] + row * a.row_bytes;
        stage.load(rows, 0, bytes, lane);
      }
      const int64_t col0 = s * a.seg;
      gguf_stage::for_each_unit(stage, rows, a.row_bytes, bytes, mine, lane,
                                [&](int blk, int64_t col, int u) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          if (t >= a.tokens) break;
          const uint32_t* xp = reinterpret_cast<const uint32_t*>(xq + t * a.k + col0 + col);
          const Word x0 = load_vec<uint32_t, 4>(xp), x1 = load_vec<uint32_t, 4>(xp + 4);
          const uint32_t xw[8] = {x0.v[0], x0.v[1], x0.v[2], x0.v[3],
                                  x1.v[0], x1.v[1], x1.v[2], x1.v[3]};
          const Vec<float, 2> ds =
              load_vec<float, 2>(xds + 2 * (t * groups + (col0 + col) / 32));
#pragma unroll
          for (int r = 0; r < NW; ++r) {
            acc[r][t] += gguf::dot32_q8<QT>(mine + r * Stage::kChunk + blk * B::kBytes, u, xw,
                                            ds.v[0], ds.v[1]);
          }
        }
      });
    }
    if (n0 + step >= a.n) allow_dependents();  // the warp's last row
    finish<1, MODE>(a, acc, n0, view.out_row, lane);
  }
}

/*! \brief int8 x values a block of the kernel for `qtype` stages (tokens * K at most). */
inline int64_t capacity(int qtype) {
  return qtype == gguf::kQ4_K ? kXCapacity : kStagedCapacity;
}

/*! \brief Whether `qtype` has kernels of 4 and 8 tokens (see kMaxTokens). */
constexpr bool takes_eight(int qtype) {
  return qtype == gguf::kQ4_K || qtype == gguf::kQ6_K || qtype == gguf::kQ8_0;
}

/*! \brief The most tokens one dense call over `qtype` rows takes. */
inline int max_tokens(int qtype) { return takes_eight(qtype) ? kMaxTokens : kMaxTokensOther; }

// Which kernel one call runs: go(kernel, blocks, threads) with the instantiation that the type,
// the weight rows per warp (Q4_K: 1 or 2, 0 = by the tokens for the dense product and 1 for the
// MoE halves; the staged types take one), the tokens (1, 2, 4 or 8 a kernel), the row length
// (Q4_K rows of K <= 2048 take the short-row kernel), the mode and the gather select. False
// for a type none reads. The launch part and the emulated tests both launch through it; the
// grid's x extent follows kResident where a.sms is set, its y extent (a.grid_y) is the
// caller's.
template <int MODE, int GATHER = kDense, class Go>
bool dispatch(const Args& a, int qtype, int64_t rows, Go&& go) {
  const int tokens = a.tokens;
  const bool short_rows = a.k / 32 <= kShortUnits;  // a Q4_K row's 16-byte units: K / 32
  auto grid = [&](int64_t rows_per_block, int resident) {
    int64_t x = ceil_div(a.n, rows_per_block);
    if (a.sms > 0) {
      const int64_t wave = ceil_div(static_cast<int64_t>(a.sms) * resident, a.grid_y);
      x = x < wave ? x : wave;
    }
    return static_cast<unsigned>(x);
  };
  auto blocks = [&](int64_t rows_per_block) { return grid(rows_per_block, kResidentQ4k); };
  auto staged = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    const unsigned x = grid(kStagedWarps, kResidentStaged);
    if constexpr (GATHER != kDense) {
      go(staged_gemv_kernel<QT, 1, MODE, GATHER>, x, kStagedThreads);
    } else if (tokens == 1) {
      go(staged_gemv_kernel<QT, 1, MODE>, x, kStagedThreads);
    } else if (tokens == 2) {
      go(staged_gemv_kernel<QT, 2, MODE>, x, kStagedThreads);
    } else if constexpr (takes_eight(QT)) {
      if (tokens <= 4) {
        go(staged_gemv_kernel<QT, 4, MODE>, x, kStagedThreads);
      } else {
        go(staged_gemv_kernel<QT, 8, MODE>, x, kStagedThreads);
      }
    } else {
      return false;
    }
    return true;
  };
  switch (qtype) {
    case gguf::kQ4_K:
      if constexpr (GATHER != kDense) {  // one token per block row; rows: 1 (0) or 2 a warp
        if (rows == 2) {
          go(q4k_gemv_kernel<2, 1, MODE, GATHER>, blocks(2 * kWarps), kThreads);
        } else if (short_rows) {
          go(q4k_gemv_kernel<1, 1, MODE, GATHER, kShortUnroll>, blocks(kWarps), kThreads);
        } else {
          go(q4k_gemv_kernel<1, 1, MODE, GATHER>, blocks(kWarps), kThreads);
        }
      } else if (tokens > 2) {  // one row a warp: 4 or 8 tokens' sums are registers enough
        if (tokens <= 4) {
          go(q4k_gemv_kernel<1, 4, MODE, kDense, kShortUnroll>, blocks(kWarps), kThreads);
        } else {
          go(q4k_gemv_kernel<1, 8, MODE, kDense, kShortUnroll>, blocks(kWarps), kThreads);
        }
      } else if (rows == 2 || (rows == 0 && tokens == 2)) {
        go(tokens == 1 ? q4k_gemv_kernel<2, 1, MODE> : q4k_gemv_kernel<2, 2, MODE>,
           blocks(2 * kWarps), kThreads);
      } else if (tokens == 2) {
        go(q4k_gemv_kernel<1, 2, MODE>, blocks(kWarps), kThreads);
      } else if (short_rows) {
        go(q4k_gemv_kernel<1, 1, MODE, kDense, kShortUnroll>, blocks(kWarps), kThreads);
      } else {
        go(q4k_gemv_kernel<1, 1, MODE>, blocks(kWarps), kThreads);
      }
      return true;
    case gguf::kQ4_0: return staged(std::integral_constant<int, gguf::kQ4_0>());
    case gguf::kQ4_1: return staged(std::integral_constant<int, gguf::kQ4_1>());
    case gguf::kQ5_0: return staged(std::integral_constant<int, gguf::kQ5_0>());
    case gguf::kQ5_1: return staged(std::integral_constant<int, gguf::kQ5_1>());
    case gguf::kQ8_0: return staged(std::integral_constant<int, gguf::kQ8_0>());
    case gguf::kQ5_K: return staged(std::integral_constant<int, gguf::kQ5_K>());
    case gguf::kQ6_K: return staged(std::integral_constant<int, gguf::kQ6_K>());
    default: return false;
  }
}

}  // namespace gemv_q8
}  // namespace freetoken
