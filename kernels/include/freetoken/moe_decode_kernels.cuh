// Device half of the small-step MoE decode (kernels/cuda/moe_decode.cu has the launches and
// the argument checks): kept apart so tests/kernel/moe_decode_emu.cc runs these very bodies on
// CPU threads through tests/kernel/emu/freetoken/cuda_common.cuh.
#pragma once

#include "freetoken/gemv_knobs.cuh"  // load_weight, wait_for_inputs, allow_dependents

namespace freetoken {
namespace moe_decode {

constexpr int kThreads = 256;
constexpr int kRows = kThreads / kWarp;  // rows per block: one warp each
constexpr int kMaxTokens = 8;
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane and row (variant 0)

// Launch shapes the benchmark sweeps (benchmarks/moe_decode_kernels.py), picked per call.
// Kind 0 (per-warp rows): gate/up one block per (pair, tile of kRows * rows rows of I), down one
// block per (token, tile of kRows * rows rows of H), a warp owning `rows` rows and walking them
// with `unroll` 16-byte loads per lane and row issued before the FMAs. Variant 0 is the
// default; 1 puts all of a lane's loads of a 2048-wide row in flight at once; 2 gives a warp two
// rows (twice the loads in flight, half the blocks); 3 is 0 held to 80 registers (`min_blocks`
// 3 resident per SM). moe_decode.cu builds gate/up's variants 1-3 (and every kind-1 variant)
// for steps of 1-2 tokens only (wider steps run variant 0).
// Kind 1 (streamed): gate/up is one wave of `min_blocks` blocks per SM whose warps take the
// row pairs of every routed expert in turn (no per-tile prologue, no partial last wave), weights
// read past L1; down is one block per (token, `rows` rows of H), held to `down_blocks` per SM,
// whose warps split the (expert, row) dot products, `units` at a time with `vecs` loads each per
// lane in flight, and meet in shared memory, where one thread per row combines them in k order.
// `pdl` launches down as a programmatic dependent of gate/up (sm_90+): its routing and first
// weights load while gate/up drains. On sm_90a bf16, gate/up at 2 blocks per SM takes 108-115
// registers (held to 3 per SM, or at 8 loads per row and 2 per SM, it spills); down
// (rows 8, units 4, vecs 3) at 2 per SM spills 48 bytes, with 2 units it does not. Variant 4 is
// 5 without the dependent launch. Three more shapes lost on both MoE shapes and were dropped
// (16 rows at 1 block per SM, 8 dots of 2 vectors, 4 rows; h200-moe_decode_kernels-0e9c8a0.txt
// numbers them 7-9).
struct Variant {
  int kind, rows, unroll, min_blocks;
  int units, vecs, down_blocks;  // kind 1 down
  bool pdl;
};
constexpr Variant kVariants[] = {
    {0, 1, kUnroll, 1, 0, 0, 0, false},      {0, 1, 2 * kUnroll, 1, 0, 0, 0, false},
    {0, 2, kUnroll, 1, 0, 0, 0, false},      {0, 1, kUnroll, 3, 0, 0, 0, false},
    {1, 8, kUnroll, 2, 4, 3, 2, false},      {1, 8, kUnroll, 2, 4, 3, 2, true},
    {1, 8, 2 * kUnroll, 1, 2, 3, 2, true},
};
constexpr int kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

struct DecodeArgs {
  void* out;               // [T, H] (down)
  const void* x;           // [T, H] normed input (gate/up)
  const void* w13;         // [S, 2I, H]
  const void* w2;          // [S, H, I]
  const int* topk_ids;     // [T, K]
  const float* topk_w;     // [T, K]
  const int* expert_map;   // [E] -> slot
  void* act;               // [T * K, I] by pair
  const void* sh_w13;      // [2Is, H] or null: shared expert
  const void* sh_w2;       // [H, Is]
  void* sh_act;            // [T, Is] (row stride sh_act_stride)
  const void* sh_gate_w;   // [1, H] or null: the shared expert's sigmoid gate
  void* sh_gate;           // [T, 1] gate logits (row stride sh_gate_stride)
  int64_t x_stride, out_stride, sh_act_stride, sh_gate_stride;
  int tokens, top_k, experts, slots, hidden, inter, sh_inter;
  bool accumulate;
};

__device__ __forceinline__ int slot_of(const DecodeArgs& a, int e) {
  if (e < 0 || e >= a.experts) return -1;
  int s = a.expert_map[e];
  return s >= 0 && s < a.slots ? s : -1;
}

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// acc[r][i] += W_r[row] . x[tok[i]] over H, one warp, lanes striding 16-byte vectors.
template <typename T, int NT, int NW, int U, int LOAD = kLoadPlain>
__device__ __forceinline__ void warp_dots(const DecodeArgs& a, const T* const (&w)[NW],
                                          const int* tok, int ntok, float (&acc)[NW][NT]) {
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(a.x);
  int lane = threadIdx.x % kWarp, nvec = a.hidden / V;
  for (int i0 = lane; i0 < nvec; i0 += U * kWarp) {
    Vec<T, V> wv[U][NW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int i = i0 + u * kWarp;
#pragma unroll
      for (int r = 0; r < NW; ++r)
        if (i < nvec) wv[u][r] = load_weight<LOAD, T, V>(w[r] + static_cast<int64_t>(i) * V);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int i = i0 + u * kWarp;
      if (i >= nvec) break;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (n >= ntok) break;
        Vec<T, V> xv = load_vec<T, V>(x + tok[n] * a.x_stride + static_cast<int64_t>(i) * V);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          float xf = to_float(xv.v[e]);
#pragma unroll
          for (int r = 0; r < NW; ++r) acc[r][n] += to_float(wv[u][r].v[e]) * xf;
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n) acc[r][n] = warp_sum(acc[r][n]);
}

template <typename T>
__device__ __forceinline__ T swiglu(float g, float u) {
  g = round_to<T>(g);
  return from_float<T>(g / (1.f + __expf(-g)) * round_to<T>(u));
}

// The ownership rule: pair p owns its expert's activations when p is the first of every NT
// pairs routed to it (so at most NT tokens per owner, always true for distinct ids per token).
// Fills pairs[] with the pairs an owner computes and returns how many, 0 when p owns nothing.
template <int NT>
__device__ __forceinline__ int pairs_owned(const int* ids, int n, int p, int* pairs) {
  int e = ids[p], rank = 0;
  for (int q = 0; q < p; ++q) rank += ids[q] == e;
  if (rank % NT != 0) return 0;
  int count = 0;
  for (int q = p; q < n && count < NT; ++q)
    if (ids[q] == e) pairs[count++] = q;
  return count;
}

// The pairs whose activations the block of pair p computes (pairs_owned), with p's slot; 0
// when the block has no work.
template <int NT>
__device__ int owned_pairs(const DecodeArgs& a, int p, int* pairs, int* slot) {
  __shared__ int s_ids[kMaxTokens * kMaxTopK];
  int n = a.tokens * a.top_k;
  for (int i = threadIdx.x; i < n; i += kThreads) s_ids[i] = a.topk_ids[i];
  __syncthreads();
  *slot = slot_of(a, s_ids[p]);
  return *slot < 0 ? 0 : pairs_owned<NT>(s_ids, n, p, pairs);
}

// Warp w of a tile owns rows j0 .. j0 + R - 1 of I (a row past I re-reads row I - 1 and is
// not written).
template <typename T, int NT, int R, int U>
__device__ void routed_gate_up(const DecodeArgs& a, int p, int tile) {
  int pairs[NT], slot, tok[NT];
  int count = owned_pairs<NT>(a, p, pairs, &slot);
  int64_t j0 = (static_cast<int64_t>(tile) * kRows + threadIdx.x / kWarp) * R;
  if (count == 0 || j0 >= a.inter) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) tok[n] = n < count ? pairs[n] / a.top_k : 0;
  int64_t H = a.hidden, I = a.inter;
  const T* g = static_cast<const T*>(a.w13) + slot * 2 * I * H;
  const T* w[2 * R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int64_t j = j0 + r < I ? j0 + r : I - 1;
    w[2 * r] = g + j * H;
    w[2 * r + 1] = g + (I + j) * H;
  }
  float acc[2 * R][NT] = {};
  warp_dots<T, NT, 2 * R, U>(a, w, tok, count, acc);
  if (threadIdx.x % kWarp != 0) return;
  T* act = static_cast<T*>(a.act);
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
      if (n < count && j0 + r < I)
        act[pairs[n] * I + j0 + r] = swiglu<T>(acc[2 * r][n], acc[2 * r + 1][n]);
}

template <typename T, int NT, int U>
__device__ void shared_gate_up(const DecodeArgs& a, int tile) {
  int64_t j = static_cast<int64_t>(tile) * kRows + threadIdx.x / kWarp;
  if (j >= a.sh_inter) return;
  int tok[NT];
#pragma unroll
  for (int n = 0; n < NT; ++n) tok[n] = n < a.tokens ? n : 0;
  int64_t H = a.hidden, I = a.sh_inter;
  const T* g = static_cast<const T*>(a.sh_w13) + j * H;
  const T* const w[2] = {g, g + I * H};
  float acc[2][NT] = {};
  warp_dots<T, NT, 2, U>(a, w, tok, a.tokens, acc);
  if (threadIdx.x % kWarp != 0) return;
  T* act = static_cast<T*>(a.sh_act);
#pragma unroll
  for (int n = 0; n < NT; ++n)
    if (n < a.tokens) act[n * a.sh_act_stride + j] = swiglu<T>(acc[0][n], acc[1][n]);
}

// warp t: the shared-expert gate logit of token t, rounded like the unfused linear.
template <typename T>
__device__ void shared_gate_logits(const DecodeArgs& a) {
  int t = threadIdx.x / kWarp;
  if (t >= a.tokens) return;
  const T* const w[1] = {static_cast<const T*>(a.sh_gate_w)};
  float acc[1][1] = {};
  warp_dots<T, 1, 1, kUnroll>(a, w, &t, 1, acc);
  if (threadIdx.x % kWarp == 0) static_cast<T*>(a.sh_gate)[t * a.sh_gate_stride] =
      from_float<T>(acc[0][0]);
}

// Flat grid: T * K * tiles(I) routed blocks (tiles of kRows * R rows), then tiles(Is) shared
// blocks (kRows rows), then one gate block.
inline int64_t gate_up_blocks(const DecodeArgs& a, int rows) {
  int64_t blocks = int64_t{a.tokens} * a.top_k * ((a.inter + kRows * rows - 1) / (kRows * rows));
  if (a.sh_w13 != nullptr) blocks += (a.sh_inter + kRows - 1) / kRows;
  return blocks + (a.sh_gate_w != nullptr ? 1 : 0);
}

template <typename T, int NT, int R, int U, int MB>
__global__ void __launch_bounds__(kThreads, MB) gate_up_kernel(DecodeArgs a) {
  int tiles = (a.inter + kRows * R - 1) / (kRows * R);
  int b = blockIdx.x, routed = a.tokens * a.top_k * tiles;
  if (b < routed) {
    routed_gate_up<T, NT, R, U>(a, b / tiles, b % tiles);
    return;
  }
  b -= routed;
  int sh_tiles = a.sh_w13 != nullptr ? (a.sh_inter + kRows - 1) / kRows : 0;
  if (b < sh_tiles) {
    shared_gate_up<T, NT, U>(a, b);
  } else if (a.sh_gate_w != nullptr) {
    shared_gate_logits<T>(a);
  }
}

// One warp: ys[r] = sum over the token's k experts of w_k * (down_s[h0 + r] . act[t * K + k]),
// walking the K * I/V vectors flat (fixed order) with U loads per row in flight; a row past H
// re-reads row H - 1 (the caller skips it).
// `act` is the token's K activation rows.
template <typename T, int R, int U>
__device__ void routed_down(const DecodeArgs& a, const T* act, int64_t h0, const int* s_slot,
                            const float* s_w, float (&ys)[R]) {
  constexpr int V = 16 / sizeof(T);
  const T* w2 = static_cast<const T*>(a.w2);
  int64_t H = a.hidden, I = a.inter, h[R];
#pragma unroll
  for (int r = 0; r < R; ++r) h[r] = h0 + r < H ? h0 + r : H - 1;
  int nvec = a.inter / V, total = a.top_k * nvec, lane = threadIdx.x % kWarp;
  float acc[R] = {};
  for (int f0 = lane; f0 < total; f0 += U * kWarp) {
    Vec<T, V> wv[U][R], av[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int f = f0 + u * kWarp, k = f / nvec;
      int64_t i = static_cast<int64_t>(f - k * nvec) * V;
      if (f < total && s_slot[k] >= 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) wv[u][r] = load_vec<T, V>(w2 + (s_slot[k] * H + h[r]) * I + i);
        av[u] = load_vec<T, V>(act + k * I + i);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      int f = f0 + u * kWarp, k = f / nvec;
      if (f >= total || s_slot[k] < 0) continue;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) d += to_float(wv[u][r].v[e]) * to_float(av[u].v[e]);
        acc[r] += s_w[k] * d;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) ys[r] = warp_sum(acc[r]);
}

// `act`: the token's shared-expert activations.
template <typename T>
__device__ float shared_down(const DecodeArgs& a, const T* act, int64_t h) {
  constexpr int V = 16 / sizeof(T);
  const T* w = static_cast<const T*>(a.sh_w2) + h * a.sh_inter;
  float acc = 0.f;
  for (int i = threadIdx.x % kWarp; i < a.sh_inter / V; i += kWarp) {
    Vec<T, V> wv = load_vec<T, V>(w + i * V), av = load_vec<T, V>(act + i * V);
#pragma unroll
    for (int e = 0; e < V; ++e) acc += to_float(wv.v[e]) * to_float(av.v[e]);
  }
  return warp_sum(acc);
}

// out[t, h] (+)= y, y from row h's routed sum and its shared-expert dot (when there is one),
// rounded as the unfused chain: the routed sum, the shared product and the gated sum once each.
template <typename T>
__device__ void store_down(const DecodeArgs& a, int64_t t, int64_t h, float routed,
                           float shared) {
  float y = round_to<T>(routed);
  if (a.sh_w2 != nullptr) {
    float s = round_to<T>(shared), g = 1.f;
    if (a.sh_gate_w != nullptr) {
      float logit = to_float(static_cast<const T*>(a.sh_gate)[t * a.sh_gate_stride]);
      g = round_to<T>(1.f / (1.f + __expf(-logit)));
    }
    y = round_to<T>(y + g * s);
  }
  T* out = static_cast<T*>(a.out) + t * a.out_stride + h;
  *out = from_float<T>(a.accumulate ? to_float(*out) + y : y);
}

// Row h of token t from its routed sum: the warp adds the shared expert's dot, lane 0 stores.
template <typename T>
__device__ void finish_down(const DecodeArgs& a, int64_t t, int64_t h, float routed,
                            const T* sh_act) {
  float shared = a.sh_w2 != nullptr ? shared_down<T>(a, sh_act, h) : 0.f;
  if (threadIdx.x % kWarp == 0) store_down<T>(a, t, h, routed, shared);
}

// Token t's expert slots and weights into shared memory (read after the next barrier).
__device__ __forceinline__ void load_routing(const DecodeArgs& a, int64_t t, int* s_slot,
                                             float* s_w) {
  int tid = threadIdx.x;
  if (tid < a.top_k) {
    int64_t p = t * a.top_k + tid;
    s_slot[tid] = slot_of(a, a.topk_ids[p]);
    s_w[tid] = a.topk_w[p];
  }
}

// Grid (T, tiles of kRows * R rows of H): token fastest, so tokens that share an expert read
// it back to back (from L2).
template <typename T, int R, int U, int MB>
__global__ void __launch_bounds__(kThreads, MB) down_kernel(DecodeArgs a) {
  __shared__ int s_slot[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  int64_t t = blockIdx.x;
  load_routing(a, t, s_slot, s_w);
  __syncthreads();
  int64_t h0 = (static_cast<int64_t>(blockIdx.y) * kRows + threadIdx.x / kWarp) * R;
  if (h0 >= a.hidden) return;
  const T* act = static_cast<const T*>(a.act) + t * a.top_k * a.inter;
  const T* sh_act = static_cast<const T*>(a.sh_act) + t * a.sh_act_stride;
  float ys[R];
  routed_down<T, R, U>(a, act, h0, s_slot, s_w, ys);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (h0 + r < a.hidden) finish_down<T>(a, t, h0 + r, ys[r], sh_act);
}

// ---------------------------------------------------------------- kind 1 (streamed)

// The owner pairs of the step (pairs_owned, decided once per block): owner o computes
// s_pairs[o][0 .. s_count[o]) with the weights of slot s_slot[o]. Returns how many owners.
template <int NT>
__device__ int owner_table(const DecodeArgs& a, int (*s_pairs)[NT], int* s_count, int* s_slot) {
  __shared__ int s_ids[kMaxTokens * kMaxTopK], s_pair_slot[kMaxTokens * kMaxTopK], s_owners;
  int n = a.tokens * a.top_k;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    s_ids[i] = a.topk_ids[i];
    s_pair_slot[i] = slot_of(a, s_ids[i]);  // the map loads run in parallel, not in the scan
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int owners = 0;
    for (int p = 0; p < n; ++p) {
      if (s_pair_slot[p] < 0) continue;
      s_count[owners] = pairs_owned<NT>(s_ids, n, p, s_pairs[owners]);
      if (s_count[owners] > 0) s_slot[owners++] = s_pair_slot[p];
    }
    s_owners = owners;
  }
  __syncthreads();
  return s_owners;
}

// Kind-1 gate/up: warp gw of W (the whole grid) takes items gw, gw + W, ...: item o * I + j is
// row j of owner o's gate and up, then come the shared expert's Is row pairs, then one item
// with every token's shared-gate logit. Each item is warp_dots of variant 0 (same bits).
template <typename T, int NT, int U, int MB>
__global__ void __launch_bounds__(kThreads, MB) gate_up_stream_kernel(DecodeArgs a) {
  __shared__ int s_pairs[kMaxTokens * kMaxTopK][NT], s_count[kMaxTokens * kMaxTopK],
      s_slot[kMaxTokens * kMaxTopK];
  int owners = owner_table<NT>(a, s_pairs, s_count, s_slot);
  const int64_t H = a.hidden, I = a.inter, routed = int64_t{owners} * I;
  const int64_t shared = a.sh_w13 != nullptr ? a.sh_inter : 0;
  const int64_t items = routed + shared + (a.sh_gate_w != nullptr ? 1 : 0);
  const int64_t warps = int64_t{gridDim.x} * kRows;
  for (int64_t it = int64_t{blockIdx.x} * kRows + threadIdx.x / kWarp; it < items; it += warps) {
    // one warp_dots for every kind of item (one register budget): the gate item's second row
    // repeats its first and is not used
    const T* w[2];
    int tok[NT], count = a.tokens, o = 0;
    int64_t j = 0;
    if (it < routed) {
      o = static_cast<int>(it / I), j = it - o * I, count = s_count[o];
      const T* g = static_cast<const T*>(a.w13) + s_slot[o] * 2 * I * H;
      w[0] = g + j * H, w[1] = g + (I + j) * H;
    } else if (it < routed + shared) {
      j = it - routed;
      w[0] = static_cast<const T*>(a.sh_w13) + j * H, w[1] = w[0] + int64_t{a.sh_inter} * H;
    } else {
      w[0] = w[1] = static_cast<const T*>(a.sh_gate_w);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
      tok[n] = it >= routed ? (n < a.tokens ? n : 0) : n < count ? s_pairs[o][n] / a.top_k : 0;
    float acc[2][NT] = {};
    warp_dots<T, NT, 2, U, kLoadNoL1>(a, w, tok, count, acc);
    if (threadIdx.x % kWarp != 0) continue;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      if (n >= count) break;
      if (it < routed) {
        static_cast<T*>(a.act)[s_pairs[o][n] * I + j] = swiglu<T>(acc[0][n], acc[1][n]);
      } else if (it < routed + shared) {
        static_cast<T*>(a.sh_act)[n * a.sh_act_stride + j] = swiglu<T>(acc[0][n], acc[1][n]);
      } else {
        static_cast<T*>(a.sh_gate)[n * a.sh_gate_stride] = from_float<T>(acc[0][n]);
      }
    }
  }
  allow_dependents();  // a programmatic-dependent down may start (it waits for these writes)
}

// The kind-1 gate/up grid: MB blocks per SM, no more than the items need.
inline int64_t gate_up_stream_blocks(const DecodeArgs& a, int sms, int min_blocks) {
  int64_t items = int64_t{a.tokens} * a.top_k * a.inter;
  if (a.sh_w13 != nullptr) items += a.sh_inter + 1;
  int64_t need = (items + kRows - 1) / kRows, wave = int64_t{sms} * min_blocks;
  return need < wave ? need : wave;
}

// Kind-1 down: block (token t, rows h0 .. h0 + RB - 1 of H). Unit (s, r) is row h0 + r of
// source s (s < K: the token's k-th routed expert, s == K: the shared expert) dotted with s's
// activations; warp w takes the contiguous run of units [w * per, (w + 1) * per), UB at a time,
// NV 16-byte weight loads per lane and unit in flight. Launched as a programmatic dependent,
// only the routing (written before gate/up started) and the weights are read before
// wait_for_inputs(); the activations, the shared gate and `out` after it.
template <typename T, int RB, int UB, int NV, int MB>
__global__ void __launch_bounds__(kThreads, MB) down_stream_kernel(DecodeArgs a) {
  constexpr int V = 16 / sizeof(T);
  __shared__ int s_slot[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  __shared__ float s_part[kMaxTopK + 1][RB];
  const int64_t t = blockIdx.x, h0 = int64_t{blockIdx.y} * RB, H = a.hidden, I = a.inter;
  load_routing(a, t, s_slot, s_w);
  __syncthreads();
  const int K = a.top_k, lane = threadIdx.x % kWarp;
  const int units = (K + (a.sh_w2 != nullptr ? 1 : 0)) * RB, per = (units + kRows - 1) / kRows;
  const int u_last = (threadIdx.x / kWarp + 1) * per, u_end = u_last < units ? u_last : units;
  const T* w2 = static_cast<const T*>(a.w2);
  const T* act = static_cast<const T*>(a.act) + t * K * I;
  const T* sh_act = static_cast<const T*>(a.sh_act) + t * a.sh_act_stride;
  bool waited = false;
  for (int u0 = threadIdx.x / kWarp * per; u0 < u_end; u0 += UB) {
    const T* wrow[UB];
    const T* arow[UB];
    int nvec[UB], most = 0;
#pragma unroll
    for (int b = 0; b < UB; ++b) {
      int u = u0 + b, s = u / RB;
      int64_t h = h0 + u % RB < H ? h0 + u % RB : H - 1;  // a row past H is not written
      nvec[b] = 0, wrow[b] = w2, arow[b] = act;
      if (u >= u_end) continue;
      if (s < K && s_slot[s] >= 0) {
        wrow[b] = w2 + (s_slot[s] * H + h) * I, arow[b] = act + s * I, nvec[b] = a.inter / V;
      } else if (s == K) {
        wrow[b] = static_cast<const T*>(a.sh_w2) + h * a.sh_inter, arow[b] = sh_act;
        nvec[b] = a.sh_inter / V;
      }
      most = nvec[b] > most ? nvec[b] : most;
    }
    float acc[UB] = {};
    for (int c0 = lane; c0 < most; c0 += NV * kWarp) {
      Vec<T, V> wv[UB][NV];
#pragma unroll
      for (int b = 0; b < UB; ++b)
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          int i = c0 + v * kWarp;
          if (i < nvec[b]) wv[b][v] = load_weight<kLoadNoL1, T, V>(wrow[b] + int64_t{i} * V);
        }
      if (!waited) wait_for_inputs();  // the activations are gate/up's output
      waited = true;
#pragma unroll
      for (int b = 0; b < UB; ++b)
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          int i = c0 + v * kWarp;
          if (i >= nvec[b]) continue;
          Vec<T, V> av = load_vec<T, V>(arow[b] + int64_t{i} * V);
#pragma unroll
          for (int e = 0; e < V; ++e) acc[b] += to_float(wv[b][v].v[e]) * to_float(av.v[e]);
        }
    }
#pragma unroll
    for (int b = 0; b < UB; ++b) {
      float sum = warp_sum(acc[b]);
      int u = u0 + b;
      if (lane == 0 && u < u_end && nvec[b] > 0) s_part[u / RB][u % RB] = sum;
    }
  }
  wait_for_inputs();  // a warp without units has not waited yet: the shared gate and out follow
  __syncthreads();
  const int r = threadIdx.x;
  if (r >= RB || h0 + r >= H) return;
  float routed = 0.f;
  for (int k = 0; k < K; ++k)
    if (s_slot[k] >= 0) routed += s_w[k] * s_part[k][r];
  store_down<T>(a, t, h0 + r, routed, a.sh_w2 != nullptr ? s_part[K][r] : 0.f);
}

}  // namespace moe_decode
}  // namespace freetoken
