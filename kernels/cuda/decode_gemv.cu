// Decode-step projections for small batches (T <= 8 tokens): out[t, n] = x[t] . W[n] with W
// [N, K] read once, in 16-byte vectors, by `group` threads per output row (a block-local
// split-K: the caller sizes `group` so that the grid fills the GPU when N is small). Optional
// prologue: x is RMS-normalised on the fly (the norm in front of the projection). Epilogues:
// + bias; residual += (the o / down projections); SwiGLU over gate/up rows n and n + I.
// Every intermediate is rounded to the activation dtype where the unfused kernels store it, so
// the results match the unfused chain up to the f32 summation order.
// Performance knobs (block size, loads in flight, cache hints, pipelining) are compiled as the
// variants of freetoken/gemv_knobs.cuh and picked per call by `variant` (0: the original);
// every variant computes the same sums in the same per-thread order up to the f32 reduction.
#include "freetoken/gemv_knobs.cuh"

namespace freetoken {
namespace {

constexpr int kMaxTokens = 8;

enum Epilogue : int { kPlain = 0, kAddResidual = 1, kSwiGLU = 2 };

struct GemvArgs {
  void* out;
  const void* x;
  const void* w;
  const void* bias;  // [N] or null (plain only)
  const void* norm;  // [K] RMSNorm weight, or null for no prologue
  int64_t x_stride, out_stride;
  int tokens, n, k_vecs, group;  // n: output columns (I for SwiGLU)
  float eps, inv_k;
};

// inv_rms[t] for the block's tokens, every thread of the block cooperating.
template <typename T, int NT, class C>
__device__ void token_inv_rms(const GemvArgs& a, float* inv_rms) {
  __shared__ float part[C::kWarps][kMaxTokens];
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(a.x);
  float ss[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) ss[t] = 0.f;
  for (int i = threadIdx.x; i < a.k_vecs; i += C::kThreads) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= a.tokens) break;
      Vec<T, V> v = load_vec<T, V>(x + t * a.x_stride + i * V);
#pragma unroll
      for (int e = 0; e < V; ++e) ss[t] += to_float(v.v[e]) * to_float(v.v[e]);
    }
  }
  int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    float s = warp_sum(ss[t]);
    if (lane == 0) part[warp][t] = s;
  }
  __syncthreads();
  if (threadIdx.x < NT) {
    float s = 0.f;
    for (int w = 0; w < C::kWarps; ++w) s += part[w][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(s * a.inv_k + a.eps);
  }
  __syncthreads();
}

// A thread's batch of weight vectors: C::kUnroll of each of its NW rows.
template <typename T, int NW, class C>
struct Batch {
  Vec<T, 16 / sizeof(T)> v[C::kUnroll][NW];
};

// Loads the batch whose first vector is i0: vectors i0, i0 + group, ... (a group reads whole
// 16-byte-per-thread rows, coalesced); those past the row (or of a row past N) are left unset.
template <typename T, int NW, class C>
__device__ __forceinline__ void load_batch(const GemvArgs& a, const T* const (&wrow)[NW], int i0,
                                           bool live, Batch<T, NW, C>& b) {
  constexpr int V = 16 / sizeof(T);
#pragma unroll
  for (int u = 0; u < C::kUnroll; ++u) {
    int i = i0 + u * a.group;
#pragma unroll
    for (int r = 0; r < NW; ++r) {
      if (live && i < a.k_vecs) {
        b.v[u][r] = load_weight<C::kLoad, T, V>(wrow[r] + static_cast<int64_t>(i) * V);
      }
    }
  }
}

// acc[r][t] += the batch's weights . x[t] (x normed on the fly when NORM).
template <typename T, int NT, int NW, bool NORM, class C>
__device__ __forceinline__ void fma_batch(const GemvArgs& a, const Batch<T, NW, C>& b, int i0,
                                          const float (&inv)[NT], float (&acc)[NW][NT]) {
  constexpr int V = 16 / sizeof(T);
  const T* x = static_cast<const T*>(a.x);
  const T* nw = static_cast<const T*>(a.norm);
#pragma unroll
  for (int u = 0; u < C::kUnroll; ++u) {
    int i = i0 + u * a.group;
    if (i >= a.k_vecs) break;
    Vec<T, V> g;
    if (NORM) g = load_vec<T, V>(nw + i * V);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      if (t >= a.tokens) break;
      Vec<T, V> xv = load_vec<T, V>(x + t * a.x_stride + i * V);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float xf = to_float(xv.v[e]);
        // the unfused norm stores its output in T: round the same way
        if (NORM) xf = to_float(from_float<T>(xf * inv[t] * to_float(g.v[e])));
#pragma unroll
        for (int r = 0; r < NW; ++r) acc[r][t] += to_float(b.v[u][r].v[e]) * xf;
      }
    }
  }
}

// acc[r][t] = W[row r] . x[t] over this thread's share of the K vectors, C::kUnroll loads in
// flight per row so that enough bytes are in flight to reach HBM bandwidth; pipelined, the
// next batch is in flight during the current one's math (`first` arrives already loaded).
template <typename T, int NT, int NW, bool NORM, class C>
__device__ __forceinline__ void dot_rows(const GemvArgs& a, const T* const (&wrow)[NW],
                                         const float* inv_rms, int lane,
                                         Batch<T, NW, C>& first, float (&acc)[NW][NT]) {
  float inv[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) inv[t] = NORM ? inv_rms[t] : 1.f;
  const int step = C::kUnroll * a.group;
  if constexpr (C::kPipe) {
    for (int i0 = lane; i0 < a.k_vecs; i0 += step) {
      Batch<T, NW, C> next;
      load_batch<T, NW, C>(a, wrow, i0 + step, true, next);
      fma_batch<T, NT, NW, NORM, C>(a, first, i0, inv, acc);
      first = next;
    }
  } else {
    for (int i0 = lane; i0 < a.k_vecs; i0 += step) {
      Batch<T, NW, C> b;
      load_batch<T, NW, C>(a, wrow, i0, true, b);
      fma_batch<T, NT, NW, NORM, C>(a, b, i0, inv, acc);
    }
  }
}

template <typename T, int MODE>
__device__ __forceinline__ void store_out(const GemvArgs& a, int n, int t, float v0, float v1) {
  T* out = static_cast<T*>(a.out) + t * a.out_stride + n;
  if (MODE == kPlain) {
    if (a.bias != nullptr) v0 += to_float(static_cast<const T*>(a.bias)[n]);
    *out = from_float<T>(v0);
  } else if (MODE == kAddResidual) {
    *out = from_float<T>(to_float(*out) + to_float(from_float<T>(v0)));
  } else {
    float g = to_float(from_float<T>(v0)), u = to_float(from_float<T>(v1));
    *out = from_float<T>(g / (1.f + __expf(-g)) * u);
  }
}

// Launched as a programmatic dependent (the pdl knob), the kernel may start before the
// previous one has finished: nothing but the weights (never written by a kernel) is read
// before wait_for_inputs(), and nothing is written before it.
template <typename T, int NT, int MODE, bool NORM, class C>
__global__ void __launch_bounds__(C::kThreads) gemv_kernel(GemvArgs a) {
  constexpr int NW = MODE == kSwiGLU ? 2 : 1;
  __shared__ float inv_rms[kMaxTokens];
  __shared__ float red[C::kWarps][NW * NT];
  int rows_per_block = C::kThreads / a.group;
  int r_local = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  int n = blockIdx.x * rows_per_block + r_local;
  bool live = n < a.n;
  const T* w = static_cast<const T*>(a.w);
  int64_t k = static_cast<int64_t>(a.k_vecs) * (16 / sizeof(T));
  const T* wrow[NW];
#pragma unroll
  for (int r = 0; r < NW; ++r) wrow[r] = w + (live ? n + static_cast<int64_t>(r) * a.n : 0) * k;
  Batch<T, NW, C> first;
  if (C::kPipe) load_batch<T, NW, C>(a, wrow, lane, live, first);  // in flight during the norm
  if (C::kPipe) wait_for_inputs();
  if (NORM) token_inv_rms<T, NT, C>(a, inv_rms);
  float acc[NW][NT];
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[r][t] = 0.f;
  if (live) dot_rows<T, NT, NW, NORM, C>(a, wrow, inv_rms, lane, first, acc);
  if (C::kPipe) allow_dependents();  // the next GEMV's weights may start streaming
  int warp = threadIdx.x / kWarp;
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float s = warp_sum(acc[r][t]);
      if (threadIdx.x % kWarp == 0) red[warp][r * NT + t] = s;
    }
  __syncthreads();
  // one thread per (row, token) adds the partial sums of its row's warps
  int warps_per_row = a.group / kWarp;
  int row = threadIdx.x / NT, t = threadIdx.x % NT;
  n = blockIdx.x * rows_per_block + row;
  if (row >= rows_per_block || n >= a.n || t >= a.tokens) return;
  float v0 = 0.f, v1 = 0.f;
  for (int w = row * warps_per_row; w < (row + 1) * warps_per_row; ++w) {
    v0 += red[w][t];
    if (NW == 2) v1 += red[w][NT + t];
  }
  store_out<T, MODE>(a, n, t, v0, v1);
}

// ---------------------------------------------------------------- launches and checks
// (tests/kernel/decode_gemv_emu.cc runs the kernel above on CPU threads, without this part)
#if !defined(FT_HOST_EMULATION)
template <typename T, int NT, int MODE, bool NORM, class C>
void launch_kernel(const GemvArgs& a, bool pdl, int device, cudaStream_t stream) {
  dim3 grid(static_cast<unsigned>(ceil_div(a.n, C::kThreads / a.group)));
  launch_maybe_pdl(gemv_kernel<T, NT, MODE, NORM, C>, grid, dim3(C::kThreads), stream, pdl,
                   device, a);
}

template <typename T, int NT, int MODE, int VARIANT>
void launch_nt(const GemvArgs& a, int device, cudaStream_t stream) {
  constexpr GemvKnobs k = kGemvVariants[VARIANT];
  using C = Knobs<k.threads, k.unroll, k.load, k.pipe>;
  static_assert(k.pipe || !k.pdl, "a programmatic dependent must load weights only, first");
  // the residual add never takes the norm prologue: no such instantiation
  if (MODE != kAddResidual && a.norm != nullptr) {
    launch_kernel<T, NT, MODE, MODE != kAddResidual, C>(a, k.pdl, device, stream);
  } else {
    launch_kernel<T, NT, MODE, false, C>(a, k.pdl, device, stream);
  }
}

template <typename T, int MODE, int VARIANT>
void launch_variant(const GemvArgs& a, int device, cudaStream_t stream) {
  if (a.tokens <= 1) {
    launch_nt<T, 1, MODE, VARIANT>(a, device, stream);
  } else if (a.tokens <= 2) {
    launch_nt<T, 2, MODE, VARIANT>(a, device, stream);
  } else if (a.tokens <= 4) {
    launch_nt<T, 4, MODE, VARIANT>(a, device, stream);
  } else {
    launch_nt<T, 8, MODE, VARIANT>(a, device, stream);
  }
}

template <typename T, int MODE, int VARIANT = 0>
void launch(const GemvArgs& a, int variant, int device, cudaStream_t stream) {
  if constexpr (VARIANT < kNumGemvVariants) {
    if (variant == VARIANT) {
      launch_variant<T, MODE, VARIANT>(a, device, stream);
    } else {
      launch<T, MODE, VARIANT + 1>(a, variant, device, stream);
    }
  }
}

void check_vector(const TensorView& t, int dev, const TensorView& like, int64_t size,
                  const char* name) {
  check_gpu(t, name, dev);
  check_same_dtype(t, like, name, "x");
  TVM_FFI_ICHECK(t.ndim() == 1 && t.size(0) == size && t.IsContiguous() && aligned16(t))
      << name << " must be a contiguous, 16-byte aligned [" << size << "] tensor";
}

// Checks every operand, fills the arguments and launches epilogue `mode`.
void run_gemv(TensorView out, TensorView x, TensorView w, tvm::ffi::Optional<TensorView> bias,
              tvm::ffi::Optional<TensorView> norm, double eps, int64_t group, int64_t variant,
              int mode) {
  int dev = x.device().device_id;
  FloatType ft = float_type(x, "x");
  TVM_FFI_ICHECK(ft != FloatType::kF32) << "decode GEMV takes bfloat16 or float16, not float32";
  check_same_dtype(w, x, "weight", "x");
  check_same_dtype(out, x, "out", "x");
  check_gpu(w, "weight", dev);
  check_ndim(w, 2, "weight");
  check_contiguous(w, "weight");
  int64_t k = w.size(1), n_rows = w.size(0);
  TVM_FFI_ICHECK(k % 8 == 0 && aligned16(w)) << "weight: K must be a multiple of 8 and aligned";
  int64_t n = mode == kSwiGLU ? n_rows / 2 : n_rows;
  TVM_FFI_ICHECK(mode != kSwiGLU || n_rows % 2 == 0) << "gate_up must have 2*I rows";
  check_aligned_rows(x, dev, "x", k);
  check_aligned_rows(out, dev, "out", n);
  int64_t tokens = x.size(0);
  TVM_FFI_ICHECK(out.size(0) == tokens) << "out and x must have the same number of rows";
  TVM_FFI_ICHECK(tokens <= kMaxTokens) << "decode GEMV takes at most " << kMaxTokens
                                       << " tokens, got " << tokens;
  TVM_FFI_ICHECK(group == 32 || group == 64 || group == 128 || group == 256)
      << "group must be 32, 64, 128 or 256 threads, got " << group;
  TVM_FFI_ICHECK(variant >= 0 && variant < kNumGemvVariants)
      << "variant must be in [0, " << kNumGemvVariants << "), got " << variant;
  TVM_FFI_ICHECK(group <= kGemvVariants[variant].threads)
      << "variant " << variant << " has blocks of " << kGemvVariants[variant].threads
      << " threads: group " << group << " does not fit";
  if (bias.has_value()) check_vector(bias.value(), dev, x, n, "bias");
  if (norm.has_value()) check_vector(norm.value(), dev, x, k, "norm_weight");
  if (tokens == 0 || n == 0) return;
  GemvArgs a{data_of<void>(out), data_of<void>(x), data_of<void>(w),
             bias.has_value() ? data_of<void>(bias.value()) : nullptr,
             norm.has_value() ? data_of<void>(norm.value()) : nullptr,
             row_view(x, 1, "x").stride, row_view(out, 1, "out").stride,
             static_cast<int>(tokens), static_cast<int>(n), static_cast<int>(k / 8),
             static_cast<int>(group), static_cast<float>(eps), 1.f / static_cast<float>(k)};
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(x);
  int v = static_cast<int>(variant);
  if (ft == FloatType::kBF16) {
    if (mode == kPlain) launch<bf16, kPlain>(a, v, dev, stream);
    if (mode == kAddResidual) launch<bf16, kAddResidual>(a, v, dev, stream);
    if (mode == kSwiGLU) launch<bf16, kSwiGLU>(a, v, dev, stream);
  } else {
    if (mode == kPlain) launch<f16, kPlain>(a, v, dev, stream);
    if (mode == kAddResidual) launch<f16, kAddResidual>(a, v, dev, stream);
    if (mode == kSwiGLU) launch<f16, kSwiGLU>(a, v, dev, stream);
  }
  check_launch("decode_gemv");
}

/*! \brief out[T, N] = norm?(x) @ weight.T (+ bias); T <= 8, bf16/f16. */
void decode_gemv(TensorView out, TensorView x, TensorView weight,
                 tvm::ffi::Optional<TensorView> bias, tvm::ffi::Optional<TensorView> norm_weight,
                 double eps, int64_t group, int64_t variant) {
  run_gemv(out, x, weight, bias, norm_weight, eps, group, variant, kPlain);
}

/*! \brief residual[T, N] += x @ weight.T (rounded to the dtype first, as the unfused add). */
void decode_gemv_add(TensorView residual, TensorView x, TensorView weight, int64_t group,
                     int64_t variant) {
  run_gemv(residual, x, weight, tvm::ffi::Optional<TensorView>(),
           tvm::ffi::Optional<TensorView>(), 0.0, group, variant, kAddResidual);
}

/*! \brief out[T, I] = silu(g) * u with [g | u] = norm?(x) @ gate_up.T (gate_up [2I, K]). */
void decode_gemv_swiglu(TensorView out, TensorView x, TensorView gate_up,
                        tvm::ffi::Optional<TensorView> norm_weight, double eps, int64_t group,
                        int64_t variant) {
  run_gemv(out, x, gate_up, tvm::ffi::Optional<TensorView>(), norm_weight, eps, group, variant,
           kSwiGLU);
}

#endif  // !FT_HOST_EMULATION
}  // namespace
}  // namespace freetoken

#if !defined(FT_HOST_EMULATION)
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_gemv, freetoken::decode_gemv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_gemv_add, freetoken::decode_gemv_add);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(decode_gemv_swiglu, freetoken::decode_gemv_swiglu);
#endif
