// MoE decode for small steps (T <= 8 tokens) in two launches after the routing, every expert
// byte streamed once in 16-byte loads:
//
//  moe_decode_gate_up  one block per (pair p = t * K + k, tile of 8 rows of I), one warp per
//                      row: act[q] = silu(gate_s . x_t) * (up_s . x_t) for every pair q routed
//                      to the same expert as p. The first such pair's blocks own the expert and
//                      run all of its tokens, the others exit, so an expert two tokens share is
//                      read once (no align pass: the T * K ids are scanned in shared memory).
//                      Extra blocks run the shared expert's gate/up and its sigmoid-gate logit.
//  moe_decode_down     one block per (token, tile of 8 rows of H), one warp per row: the warp
//                      walks the token's K experts' rows in a fixed order (no atomics) and
//                      writes y = sum_k w_k * (down_s . act) [+ sigmoid(g) * shared], or adds
//                      it to the residual stream.
//
// Slots come from topk_ids through expert_map (offload slot pools; an unmapped expert is
// skipped, as in moe_experts). No host sync: the launch shape depends on (T, K, I) alone.
// Rounding follows the unfused chain: gate, up and the shared products are rounded to the
// dtype before their SwiGLU / gate, the routed sum once, the residual add once.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

constexpr int kThreads = 256;
constexpr int kRows = kThreads / kWarp;  // rows per block: one warp each
constexpr int kMaxTokens = 8;
constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;
constexpr int kUnroll = 4;  // 16-byte weight loads in flight per lane and row

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
template <typename T, int NT, int NW>
__device__ __forceinline__ void warp_dots(const DecodeArgs& a, const T* const (&w)[NW],
                                          const int* tok, int ntok, float (&acc)[NW][NT]) {
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(a.x);
  int lane = threadIdx.x % kWarp, nvec = a.hidden / V;
  for (int i0 = lane; i0 < nvec; i0 += kUnroll * kWarp) {
    Vec<T, V> wv[kUnroll][NW];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int i = i0 + u * kWarp;
#pragma unroll
      for (int r = 0; r < NW; ++r)
        if (i < nvec) wv[u][r] = load_vec<T, V>(w[r] + static_cast<int64_t>(i) * V);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
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

// The pairs whose activations this block computes: the block of pair p owns p's expert when p
// is the first of every NT pairs routed to it (so at most NT tokens per owner, always true for
// distinct ids per token). Fills pairs[] and returns how many, 0 when the block has no work.
template <int NT>
__device__ int owned_pairs(const DecodeArgs& a, int p, int* pairs, int* slot) {
  __shared__ int s_ids[kMaxTokens * kMaxTopK];
  int n = a.tokens * a.top_k;
  for (int i = threadIdx.x; i < n; i += kThreads) s_ids[i] = a.topk_ids[i];
  __syncthreads();
  int e = s_ids[p];
  *slot = slot_of(a, e);
  int rank = 0;
  for (int q = 0; q < p; ++q) rank += s_ids[q] == e;
  if (*slot < 0 || rank % NT != 0) return 0;
  int count = 0;
  for (int q = p; q < n && count < NT; ++q)
    if (s_ids[q] == e) pairs[count++] = q;
  return count;
}

template <typename T, int NT>
__device__ void routed_gate_up(const DecodeArgs& a, int p, int tile) {
  int pairs[NT], slot, tok[NT];
  int count = owned_pairs<NT>(a, p, pairs, &slot);
  int64_t j = static_cast<int64_t>(tile) * kRows + threadIdx.x / kWarp;
  if (count == 0 || j >= a.inter) return;
#pragma unroll
  for (int n = 0; n < NT; ++n) tok[n] = n < count ? pairs[n] / a.top_k : 0;
  int64_t H = a.hidden, I = a.inter;
  const T* g = static_cast<const T*>(a.w13) + (slot * 2 * I + j) * H;
  const T* const w[2] = {g, g + I * H};
  float acc[2][NT] = {};
  warp_dots<T, NT, 2>(a, w, tok, count, acc);
  if (threadIdx.x % kWarp != 0) return;
  T* act = static_cast<T*>(a.act);
#pragma unroll
  for (int n = 0; n < NT; ++n)
    if (n < count) act[pairs[n] * I + j] = swiglu<T>(acc[0][n], acc[1][n]);
}

template <typename T, int NT>
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
  warp_dots<T, NT, 2>(a, w, tok, a.tokens, acc);
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
  warp_dots<T, 1, 1>(a, w, &t, 1, acc);
  if (threadIdx.x % kWarp == 0) static_cast<T*>(a.sh_gate)[t * a.sh_gate_stride] =
      from_float<T>(acc[0][0]);
}

// Flat grid: T * K * tiles(I) routed blocks, then tiles(Is) shared blocks, then one gate block.
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads) gate_up_kernel(DecodeArgs a) {
  int tiles = (a.inter + kRows - 1) / kRows;
  int b = blockIdx.x, routed = a.tokens * a.top_k * tiles;
  if (b < routed) {
    routed_gate_up<T, NT>(a, b / tiles, b % tiles);
    return;
  }
  b -= routed;
  int sh_tiles = a.sh_w13 != nullptr ? (a.sh_inter + kRows - 1) / kRows : 0;
  if (b < sh_tiles) {
    shared_gate_up<T, NT>(a, b);
  } else if (a.sh_gate_w != nullptr) {
    shared_gate_logits<T>(a);
  }
}

// One warp: sum over the token's k experts of w_k * (down_s[h] . act[t * K + k]), walking the
// K * I/V vectors flat (fixed order) with kUnroll loads in flight; then the shared expert.
template <typename T>
__device__ float routed_down(const DecodeArgs& a, int64_t t, int64_t h, const int* s_slot,
                             const float* s_w) {
  constexpr int V = 16 / sizeof(T);
  const T* w2 = static_cast<const T*>(a.w2);
  const T* act = static_cast<const T*>(a.act) + t * a.top_k * a.inter;
  int64_t H = a.hidden, I = a.inter;
  int nvec = a.inter / V, total = a.top_k * nvec, lane = threadIdx.x % kWarp;
  float acc = 0.f;
  for (int f0 = lane; f0 < total; f0 += kUnroll * kWarp) {
    Vec<T, V> wv[kUnroll], av[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int f = f0 + u * kWarp, k = f / nvec;
      int64_t i = static_cast<int64_t>(f - k * nvec) * V;
      if (f < total && s_slot[k] >= 0) {
        wv[u] = load_vec<T, V>(w2 + (s_slot[k] * H + h) * I + i);
        av[u] = load_vec<T, V>(act + k * I + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int f = f0 + u * kWarp, k = f / nvec;
      if (f >= total || s_slot[k] < 0) continue;
      float d = 0.f;
#pragma unroll
      for (int e = 0; e < V; ++e) d += to_float(wv[u].v[e]) * to_float(av[u].v[e]);
      acc += s_w[k] * d;
    }
  }
  return warp_sum(acc);
}

template <typename T>
__device__ float shared_down(const DecodeArgs& a, int64_t t, int64_t h) {
  constexpr int V = 16 / sizeof(T);
  const T* w = static_cast<const T*>(a.sh_w2) + h * a.sh_inter;
  const T* act = static_cast<const T*>(a.sh_act) + t * a.sh_act_stride;
  float acc = 0.f;
  for (int i = threadIdx.x % kWarp; i < a.sh_inter / V; i += kWarp) {
    Vec<T, V> wv = load_vec<T, V>(w + i * V), av = load_vec<T, V>(act + i * V);
#pragma unroll
    for (int e = 0; e < V; ++e) acc += to_float(wv.v[e]) * to_float(av.v[e]);
  }
  return warp_sum(acc);
}

// Grid (T, tiles of H): token fastest, so tokens that share an expert read it back to back
// (from L2).
template <typename T>
__global__ void __launch_bounds__(kThreads) down_kernel(DecodeArgs a) {
  __shared__ int s_slot[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  int64_t t = blockIdx.x;
  if (threadIdx.x < a.top_k) {
    int64_t p = t * a.top_k + threadIdx.x;
    s_slot[threadIdx.x] = slot_of(a, a.topk_ids[p]);
    s_w[threadIdx.x] = a.topk_w[p];
  }
  __syncthreads();
  int64_t h = static_cast<int64_t>(blockIdx.y) * kRows + threadIdx.x / kWarp;
  if (h >= a.hidden) return;
  float y = round_to<T>(routed_down<T>(a, t, h, s_slot, s_w));
  if (a.sh_w2 != nullptr) {
    float s = round_to<T>(shared_down<T>(a, t, h));
    float g = 1.f;
    if (a.sh_gate_w != nullptr) {
      float logit = to_float(static_cast<const T*>(a.sh_gate)[t * a.sh_gate_stride]);
      g = round_to<T>(1.f / (1.f + __expf(-logit)));
    }
    y = round_to<T>(y + g * s);
  }
  if (threadIdx.x % kWarp != 0) return;
  T* out = static_cast<T*>(a.out) + t * a.out_stride + h;
  *out = from_float<T>(a.accumulate ? to_float(*out) + y : y);
}

// ---------------------------------------------------------------- host side

template <typename T>
void launch_gate_up(const DecodeArgs& a, cudaStream_t stream) {
  int64_t blocks = a.tokens * a.top_k * ceil_div(a.inter, kRows);
  if (a.sh_w13 != nullptr) blocks += ceil_div(a.sh_inter, kRows);
  if (a.sh_gate_w != nullptr) blocks += 1;
  dim3 grid(static_cast<unsigned>(blocks));
  if (a.tokens <= 1) {
    gate_up_kernel<T, 1><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.tokens <= 2) {
    gate_up_kernel<T, 2><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.tokens <= 4) {
    gate_up_kernel<T, 4><<<grid, kThreads, 0, stream>>>(a);
  } else {
    gate_up_kernel<T, 8><<<grid, kThreads, 0, stream>>>(a);
  }
  check_launch("moe_decode_gate_up");
}

template <typename T>
void launch_down(const DecodeArgs& a, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(a.tokens), static_cast<unsigned>(ceil_div(a.hidden, kRows)));
  down_kernel<T><<<grid, kThreads, 0, stream>>>(a);
  check_launch("moe_decode_down");
}

void check_rows(const TensorView& t, int dev, const TensorView& like, const char* name,
                int64_t rows, int64_t cols, int64_t* stride) {
  check_gpu(t, name, dev);
  check_same_dtype(t, like, name, "x");
  check_ndim(t, 2, name);
  RowView rv = row_view(t, 1, name);
  TVM_FFI_ICHECK(t.size(0) == rows && rv.width == cols)
      << name << " must be [" << rows << ", " << cols << "], got [" << t.size(0) << ", "
      << rv.width << "]";
  TVM_FFI_ICHECK(rv.stride % 8 == 0 && aligned16(t))
      << name << " rows must start on 16-byte boundaries (row stride a multiple of 8)";
  *stride = rv.stride;
}

void check_weight(const TensorView& t, int dev, const TensorView& like, const char* name,
                  int ndim) {
  check_gpu(t, name, dev);
  check_same_dtype(t, like, name, "x");
  check_ndim(t, ndim, name);
  check_contiguous(t, name);
  TVM_FFI_ICHECK(aligned16(t)) << name << " must be 16-byte aligned";
}

// Checks the arguments both kernels share and fills the routed half of `a`.
DecodeArgs routed_args(const TensorView& x, const TensorView& w13, const TensorView& w2,
                       const TensorView& topk_ids, const TensorView& expert_map,
                       const TensorView& workspace) {
  int dev = x.device().device_id;
  FloatType ft = float_type(x, "x");
  TVM_FFI_ICHECK(ft != FloatType::kF32) << "moe decode takes bfloat16 or float16, not float32";
  check_weight(w13, dev, x, "w13", 3);
  check_weight(w2, dev, x, "w2", 3);
  int64_t S = w13.size(0), I = w13.size(1) / 2, H = w13.size(2), T = topk_ids.size(0);
  TVM_FFI_ICHECK(w13.size(1) % 2 == 0 && H % 8 == 0 && I % 8 == 0)
      << "w13 must be [S, 2I, H] with H and I multiples of 8";
  TVM_FFI_ICHECK(w2.size(0) == S && w2.size(1) == H && w2.size(2) == I)
      << "w2 must be [S, H, I] = [" << S << ", " << H << ", " << I << "] (from w13)";
  check_gpu(topk_ids, "topk_ids", dev);
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  check_ndim(topk_ids, 2, "topk_ids");
  check_contiguous(topk_ids, "topk_ids");
  int64_t K = topk_ids.size(1), E = expert_map.size(0);
  TVM_FFI_ICHECK(T <= kMaxTokens) << "moe decode takes at most " << kMaxTokens
                                  << " tokens, got " << T;
  TVM_FFI_ICHECK(K >= 1 && K <= kMaxTopK) << "top_k must be in 1.." << kMaxTopK << ", got " << K;
  check_gpu(expert_map, "expert_map", dev);
  check_dtype(expert_map, kDLInt, 32, "expert_map", "int32");
  TVM_FFI_ICHECK(expert_map.ndim() == 1 && expert_map.IsContiguous() && E >= 1 &&
                 E <= kMaxExperts)
      << "expert_map must be a contiguous int32 [E] with 1 <= E <= " << kMaxExperts;
  check_gpu(workspace, "workspace", dev);
  int64_t need = T * K * I * 2;
  TVM_FFI_ICHECK(workspace.ndim() == 1 && workspace.IsContiguous() && aligned16(workspace) &&
                 workspace.size(0) * (workspace.dtype().bits / 8) >= need)
      << "workspace must be a contiguous, 16-byte aligned buffer of at least " << need
      << " bytes (T * K * I activations)";
  DecodeArgs a{};
  a.x = data_of<void>(x);
  a.w13 = data_of<void>(w13);
  a.w2 = data_of<void>(w2);
  a.topk_ids = data_of<int>(topk_ids);
  a.expert_map = data_of<int>(expert_map);
  a.act = data_of<void>(workspace);
  a.tokens = static_cast<int>(T);
  a.top_k = static_cast<int>(K);
  a.experts = static_cast<int>(E);
  a.slots = static_cast<int>(S);
  a.hidden = static_cast<int>(H);
  a.inter = static_cast<int>(I);
  return a;
}

// The shared expert's operands: all given, or w13/w2/act all absent (gate optional).
void shared_args(DecodeArgs* a, const TensorView& x, tvm::ffi::Optional<TensorView> sh_w13,
                 tvm::ffi::Optional<TensorView> sh_w2, tvm::ffi::Optional<TensorView> sh_act,
                 tvm::ffi::Optional<TensorView> sh_gate_w,
                 tvm::ffi::Optional<TensorView> sh_gate, bool need_w13, bool need_w2) {
  int dev = x.device().device_id;
  if (!sh_act.has_value()) {
    TVM_FFI_ICHECK(!sh_gate_w.has_value() && !sh_gate.has_value())
        << "a shared-expert gate needs the shared expert (shared_act)";
    return;
  }
  int64_t H = a->hidden;
  if (need_w13) {
    TVM_FFI_ICHECK(sh_w13.has_value()) << "shared_act given without shared_w13";
    check_weight(sh_w13.value(), dev, x, "shared_w13", 2);
    a->sh_w13 = data_of<void>(sh_w13.value());
    a->sh_inter = static_cast<int>(sh_w13.value().size(0) / 2);
    TVM_FFI_ICHECK(sh_w13.value().size(1) == H && sh_w13.value().size(0) % 16 == 0)
        << "shared_w13 must be [2Is, " << H << "] with Is a multiple of 8";
  }
  if (need_w2) {
    TVM_FFI_ICHECK(sh_w2.has_value()) << "shared_act given without shared_w2";
    check_weight(sh_w2.value(), dev, x, "shared_w2", 2);
    a->sh_w2 = data_of<void>(sh_w2.value());
    a->sh_inter = static_cast<int>(sh_w2.value().size(1));
    TVM_FFI_ICHECK(sh_w2.value().size(0) == H && a->sh_inter % 8 == 0)
        << "shared_w2 must be [" << H << ", Is] with Is a multiple of 8";
  }
  check_rows(sh_act.value(), dev, x, "shared_act", a->tokens, a->sh_inter, &a->sh_act_stride);
  a->sh_act = data_of<void>(sh_act.value());
  if (!sh_gate.has_value()) return;
  check_gpu(sh_gate.value(), "shared_gate", dev);
  check_same_dtype(sh_gate.value(), x, "shared_gate", "x");
  RowView rv = row_view(sh_gate.value(), 1, "shared_gate");
  TVM_FFI_ICHECK(sh_gate.value().ndim() == 2 && rv.rows == a->tokens && rv.width == 1)
      << "shared_gate must be [" << a->tokens << ", 1]";
  a->sh_gate = data_of<void>(sh_gate.value());
  a->sh_gate_stride = rv.stride;
  if (need_w13) {
    TVM_FFI_ICHECK(sh_gate_w.has_value()) << "shared_gate given without shared_gate_weight";
    check_weight(sh_gate_w.value(), dev, x, "shared_gate_weight", 2);
    TVM_FFI_ICHECK(sh_gate_w.value().size(0) == 1 && sh_gate_w.value().size(1) == H)
        << "shared_gate_weight must be [1, " << H << "]";
    a->sh_gate_w = data_of<void>(sh_gate_w.value());
  } else {
    a->sh_gate_w = a->sh_gate;  // down: marks "gated"; it reads only sh_gate
  }
}

/*! \brief act[T*K, I] (in workspace) and the shared expert's act / gate logit; see the top. */
void moe_decode_gate_up(TensorView x, TensorView w13, TensorView w2, TensorView topk_ids,
                        TensorView expert_map, TensorView workspace,
                        tvm::ffi::Optional<TensorView> shared_w13,
                        tvm::ffi::Optional<TensorView> shared_act,
                        tvm::ffi::Optional<TensorView> shared_gate_weight,
                        tvm::ffi::Optional<TensorView> shared_gate) {
  DecodeArgs a = routed_args(x, w13, w2, topk_ids, expert_map, workspace);
  int dev = x.device().device_id;
  check_rows(x, dev, x, "x", a.tokens, a.hidden, &a.x_stride);
  shared_args(&a, x, shared_w13, tvm::ffi::Optional<TensorView>(), shared_act,
              shared_gate_weight, shared_gate, true, false);
  if (a.tokens == 0) return;
  DeviceGuard guard(dev);
  if (float_type(x, "x") == FloatType::kBF16) {
    launch_gate_up<bf16>(a, stream_for(x));
  } else {
    launch_gate_up<f16>(a, stream_for(x));
  }
}

/*! \brief out[T, H] (+)= sum_k w_k down_s(act) [+ sigmoid(gate) * shared_down(shared_act)]. */
void moe_decode_down(TensorView out, TensorView w13, TensorView w2, TensorView topk_ids,
                     TensorView topk_weights, TensorView expert_map, TensorView workspace,
                     tvm::ffi::Optional<TensorView> shared_w2,
                     tvm::ffi::Optional<TensorView> shared_act,
                     tvm::ffi::Optional<TensorView> shared_gate, bool accumulate) {
  DecodeArgs a = routed_args(out, w13, w2, topk_ids, expert_map, workspace);
  int dev = out.device().device_id;
  check_rows(out, dev, out, "out", a.tokens, a.hidden, &a.out_stride);
  check_gpu(topk_weights, "topk_weights", dev);
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  TVM_FFI_ICHECK(topk_weights.ndim() == 2 && topk_weights.IsContiguous() &&
                 topk_weights.size(0) == a.tokens && topk_weights.size(1) == a.top_k)
      << "topk_weights must be a contiguous float32 [T, K] like topk_ids";
  a.out = data_of<void>(out);
  a.topk_w = data_of<float>(topk_weights);
  a.accumulate = accumulate;
  shared_args(&a, out, tvm::ffi::Optional<TensorView>(), shared_w2, shared_act,
              tvm::ffi::Optional<TensorView>(), shared_gate, false, true);
  if (a.tokens == 0) return;
  DeviceGuard guard(dev);
  if (float_type(out, "out") == FloatType::kBF16) {
    launch_down<bf16>(a, stream_for(out));
  } else {
    launch_down<f16>(a, stream_for(out));
  }
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_decode_gate_up, freetoken::moe_decode_gate_up);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_decode_down, freetoken::moe_decode_down);
