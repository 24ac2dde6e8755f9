// After the QKV projection, in one launch: the optional per-head q/k RMSNorm, rotary embedding
// of q (in place) and k, and the store of k and v into the paged pool (k rotated). One block per
// token, one warp per head. Values are rounded to the dtype where the unfused chain
// (rms_norm -> rotary_embedding -> store_kv) stores them, so the results are identical to it.
// rope_store_kv_fp8 stores k (normed and rotated, rounded to the dtype as above) and v into the
// FP8 pool instead, quantized as store_kv_fp8 quantizes them (freetoken/fp8_encode.h).
#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_kv.cuh"
#include "freetoken/gguf_stage.cuh"  // warp_sync

namespace freetoken {
namespace {

using gguf_stage::warp_sync;

constexpr int kHeadsPerBlock = 8;

struct RopeKvArgs {
  const int64_t* positions;
  const int64_t* slots;
  void* q;
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  float* k_scale;  // the FP8 pool's [S, Hk] scales (null for a pool of the dtype)
  float* v_scale;
  const float* cos_sin;
  const void* q_norm;  // [D] or null
  const void* k_norm;  // [D] or null
  int64_t q_stride, k_stride, v_stride, max_pos, num_slots;
  int q_heads, kv_heads, head_dim, rot_dim;
  float eps;
  bool neox;
};

// Element d of the head after the optional norm, rounded as the unfused norm stores it.
template <typename T>
__device__ __forceinline__ float normed(const T* src, const T* w, float inv, int d) {
  float x = to_float(src[d]);
  return w == nullptr ? x : to_float(from_float<T>(x * inv * to_float(w[d])));
}

// One head: src -> dst (dst may be src), normalised and rotated (when cos is not null).
template <typename T>
__device__ void rope_head(const T* src, T* dst, const T* w, const float* cos, int lane,
                          const RopeKvArgs& a) {
  int d_all = a.head_dim, half = a.rot_dim / 2;
  float inv = 1.f;
  if (w != nullptr) {
    float ss = 0.f;
    for (int d = lane; d < d_all; d += kWarp) ss += to_float(src[d]) * to_float(src[d]);
    inv = rsqrtf(warp_sum(ss) / static_cast<float>(d_all) + a.eps);
  }
  // every lane has read its share above before any lane writes (warp_sum synchronises)
  int rot = cos == nullptr ? 0 : a.rot_dim;
  for (int j = lane; j < rot / 2; j += kWarp) {
    int ia = a.neox ? j : 2 * j, ib = a.neox ? j + half : 2 * j + 1;
    float x1 = normed(src, w, inv, ia), x2 = normed(src, w, inv, ib);
    float c = cos[j], s = cos[half + j];
    dst[ia] = from_float<T>(x1 * c - x2 * s);
    dst[ib] = from_float<T>(x2 * c + x1 * s);
  }
  for (int d = rot + lane; d < d_all; d += kWarp) dst[d] = from_float<T>(normed(src, w, inv, d));
}

// Where k and v land. A pool of the dtype takes the rotated k straight from rope_head; the FP8
// pool needs a row's largest magnitude before its first code, so rope_head writes the rounded k
// to the warp's row of shared memory (`stage`, head_dim elements), which is then quantized.
template <typename T, bool kFp8>
__device__ __forceinline__ void store_k_row(const T* src, const float* cos, T* stage,
                                            int64_t row, int lane, const RopeKvArgs& a) {
  const T* w = static_cast<const T*>(a.k_norm);
  if constexpr (kFp8) {
    rope_head<T>(src, stage, w, cos, lane, a);
    warp_sync();  // lanes quantize elements other lanes rotated
    fp8::store_row<T>(stage, static_cast<uint8_t*>(a.k_cache) + row * a.head_dim,
                     a.k_scale + row, a.head_dim, lane);
    warp_sync();  // read before this warp's next k row overwrites the stage
  } else {
    rope_head<T>(src, static_cast<T*>(a.k_cache) + row * a.head_dim, w, cos, lane, a);
  }
}

template <typename T, bool kFp8>
__device__ __forceinline__ void store_v_row(const T* src, int64_t row, int lane,
                                            const RopeKvArgs& a) {
  if constexpr (kFp8) {
    fp8::store_row<T>(src, static_cast<uint8_t*>(a.v_cache) + row * a.head_dim, a.v_scale + row,
                     a.head_dim, lane);
  } else {
    T* dst = static_cast<T*>(a.v_cache) + row * a.head_dim;
    for (int d = lane; d < a.head_dim; d += kWarp) dst[d] = src[d];
  }
}

// kFp8: the FP8 pool, with kHeadsPerBlock * head_dim elements of dynamic shared memory.
template <typename T, bool kFp8>
__global__ void rope_store_kv_kernel(RopeKvArgs a) {
  extern __shared__ float stage_raw[];  // dynamic: sized for T rows (FP8 only)
  int64_t t = blockIdx.x;
  int64_t pos = a.positions[t], slot = a.slots[t];
  // out of the table: unrotated, as rotary_embedding leaves it
  const float* cos = pos >= 0 && pos < a.max_pos ? a.cos_sin + pos * a.rot_dim : nullptr;
  bool store = slot >= 0 && slot < a.num_slots;
  int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  int heads = a.q_heads + 2 * a.kv_heads;
  T* stage = reinterpret_cast<T*>(stage_raw) + static_cast<int64_t>(warp) * a.head_dim;
  for (int h = blockIdx.y * kHeadsPerBlock + warp; h < heads;
       h += gridDim.y * kHeadsPerBlock) {
    if (h < a.q_heads) {
      T* qh = static_cast<T*>(a.q) + t * a.q_stride + static_cast<int64_t>(h) * a.head_dim;
      rope_head<T>(qh, qh, static_cast<const T*>(a.q_norm), cos, lane, a);
    } else if (h < a.q_heads + a.kv_heads) {
      int kh = h - a.q_heads;
      if (!store) continue;
      const T* src = static_cast<const T*>(a.k) + t * a.k_stride +
                     static_cast<int64_t>(kh) * a.head_dim;
      store_k_row<T, kFp8>(src, cos, stage, slot * a.kv_heads + kh, lane, a);
    } else if (store) {
      int vh = h - a.q_heads - a.kv_heads;
      const T* src = static_cast<const T*>(a.v) + t * a.v_stride +
                     static_cast<int64_t>(vh) * a.head_dim;
      store_v_row<T, kFp8>(src, slot * a.kv_heads + vh, lane, a);
    }
  }
}

// Heads of a [T, H*D] tensor whose rows hold H*D contiguous elements.
int heads_of(const TensorView& t, int64_t tokens, int64_t head_dim, const char* name,
             int64_t* token_stride) {
  TVM_FFI_ICHECK(t.ndim() == 2 && t.size(0) == tokens)
      << name << " must be [T, H*D] with T = len(positions) = " << tokens;
  RowView rv = row_view(t, 1, name);
  TVM_FFI_ICHECK(rv.width % head_dim == 0)
      << name << " rows hold " << rv.width << " elements, not a multiple of head_dim "
      << head_dim;
  *token_stride = rv.stride;
  return static_cast<int>(rv.width / head_dim);
}

const void* norm_of(const tvm::ffi::Optional<TensorView>& w, const TensorView& q,
                    int64_t head_dim, const char* name) {
  if (!w.has_value()) return nullptr;
  const TensorView& t = w.value();
  check_gpu(t, name, q.device().device_id);
  check_same_dtype(t, q, name, "q");
  TVM_FFI_ICHECK(t.ndim() == 1 && t.size(0) == head_dim && t.IsContiguous())
      << name << " must be a contiguous [" << head_dim << "] tensor";
  return data_of<void>(t);
}

// A pool of q's dtype, or (fp8) of e4m3 codes.
void check_cache(const TensorView& c, const TensorView& q, int64_t kv_heads, int64_t head_dim,
                 const char* name, bool fp8 = false) {
  check_gpu(c, name, q.device().device_id);
  if (fp8) {
    check_dtype(c, kDLUInt, 8, name, "uint8 (e4m3 codes)");
  } else {
    check_same_dtype(c, q, name, "q");
  }
  check_contiguous(c, name);
  TVM_FFI_ICHECK(c.ndim() == 3 && c.size(1) == kv_heads && c.size(2) == head_dim)
      << name << " must be [S, " << kv_heads << ", " << head_dim << "]";
}

// Checks what both entry points share and fills every field but the pool's.
RopeKvArgs check_args(const TensorView& positions, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& cos_sin_cache,
                      const TensorView& slot_mapping, const tvm::ffi::Optional<TensorView>& q_norm,
                      const tvm::ffi::Optional<TensorView>& k_norm, double eps, int64_t head_dim,
                      bool is_neox) {
  int dev = q.device().device_id;
  for (const TensorView* t : {&positions, &k, &v, &cos_sin_cache, &slot_mapping}) {
    check_gpu(*t, "every argument", dev);
  }
  float_type(q, "q");
  check_same_dtype(k, q, "k", "q");
  check_same_dtype(v, q, "v", "q");
  check_dtype(positions, kDLInt, 64, "positions", "int64");
  check_dtype(slot_mapping, kDLInt, 64, "slot_mapping", "int64");
  check_dtype(cos_sin_cache, kDLFloat, 32, "cos_sin_cache", "float32");
  int64_t tokens = positions.size(0);
  TVM_FFI_ICHECK(positions.ndim() == 1 && positions.IsContiguous() &&
                 slot_mapping.ndim() == 1 && slot_mapping.IsContiguous() &&
                 slot_mapping.size(0) == tokens)
      << "positions and slot_mapping must be contiguous [T] tensors of the same length";
  TVM_FFI_ICHECK(cos_sin_cache.ndim() == 2 && cos_sin_cache.IsContiguous())
      << "cos_sin_cache must be a contiguous [max_pos, rot_dim] tensor";
  int64_t rot = cos_sin_cache.size(1);
  TVM_FFI_ICHECK(head_dim > 0 && rot % 2 == 0 && rot > 0 && rot <= head_dim)
      << "cos_sin_cache's rot_dim " << rot << " must be even and at most head_dim " << head_dim;
  RopeKvArgs a{};
  a.positions = data_of<int64_t>(positions);
  a.slots = data_of<int64_t>(slot_mapping);
  a.q = data_of<void>(q);
  a.k = data_of<void>(k);
  a.v = data_of<void>(v);
  a.cos_sin = data_of<float>(cos_sin_cache);
  a.q_norm = norm_of(q_norm, q, head_dim, "q_norm");
  a.k_norm = norm_of(k_norm, q, head_dim, "k_norm");
  a.max_pos = cos_sin_cache.size(0);
  a.head_dim = static_cast<int>(head_dim);
  a.rot_dim = static_cast<int>(rot);
  a.eps = static_cast<float>(eps);
  a.neox = is_neox;
  a.q_heads = heads_of(q, tokens, head_dim, "q", &a.q_stride);
  a.kv_heads = heads_of(k, tokens, head_dim, "k", &a.k_stride);
  TVM_FFI_ICHECK(heads_of(v, tokens, head_dim, "v", &a.v_stride) == a.kv_heads)
      << "k and v must have the same number of heads";
  return a;
}

template <bool kFp8>
void launch(const RopeKvArgs& a, const TensorView& q, const char* name) {
  int64_t tokens = q.size(0);
  if (tokens == 0) return;
  DeviceGuard guard(q.device().device_id);
  int heads = a.q_heads + 2 * a.kv_heads;
  dim3 grid(static_cast<unsigned>(tokens),
            static_cast<unsigned>(ceil_div(heads, kHeadsPerBlock)));
  cudaStream_t stream = stream_for(q);
  FT_CUDA_DISPATCH_FLOAT(float_type(q, "q"), T, {
    size_t stage = kFp8 ? sizeof(T) * kHeadsPerBlock * a.head_dim : 0;  // one k row per warp
    rope_store_kv_kernel<T, kFp8><<<grid, kHeadsPerBlock * kWarp, stage, stream>>>(a);
  });
  check_launch(name);
}

/*! \brief q/k norm (optional, per head) + rope on q (in place) and k, k and v into the pool. */
void rope_store_kv(TensorView positions, TensorView q, TensorView k, TensorView v,
                   TensorView cos_sin_cache, TensorView k_cache, TensorView v_cache,
                   TensorView slot_mapping, tvm::ffi::Optional<TensorView> q_norm,
                   tvm::ffi::Optional<TensorView> k_norm, double eps, int64_t head_dim,
                   bool is_neox) {
  RopeKvArgs a = check_args(positions, q, k, v, cos_sin_cache, slot_mapping, q_norm, k_norm,
                            eps, head_dim, is_neox);
  check_cache(k_cache, q, a.kv_heads, head_dim, "k_cache");
  check_cache(v_cache, q, a.kv_heads, head_dim, "v_cache");
  TVM_FFI_ICHECK(v_cache.size(0) == k_cache.size(0)) << "k_cache and v_cache must match";
  a.k_cache = data_of<void>(k_cache);
  a.v_cache = data_of<void>(v_cache);
  a.num_slots = k_cache.size(0);
  launch<false>(a, q, "rope_store_kv");
}

/*!
 * \brief rope_store_kv into the FP8 pool: k (normed, rotated, rounded to q's dtype) and v
 * quantized into e4m3 codes k_cache, v_cache uint8 [S, Hk, D] with scales k_scale, v_scale
 * float32 [S, Hk], as store_kv_fp8 writes them.
 */
void rope_store_kv_fp8(TensorView positions, TensorView q, TensorView k, TensorView v,
                       TensorView cos_sin_cache, TensorView k_cache, TensorView v_cache,
                       TensorView k_scale, TensorView v_scale, TensorView slot_mapping,
                       tvm::ffi::Optional<TensorView> q_norm,
                       tvm::ffi::Optional<TensorView> k_norm, double eps, int64_t head_dim,
                       bool is_neox) {
  RopeKvArgs a = check_args(positions, q, k, v, cos_sin_cache, slot_mapping, q_norm, k_norm,
                            eps, head_dim, is_neox);
  check_cache(k_cache, q, a.kv_heads, head_dim, "k_cache", true);
  check_cache(v_cache, q, a.kv_heads, head_dim, "v_cache", true);
  TVM_FFI_ICHECK(v_cache.size(0) == k_cache.size(0)) << "k_cache and v_cache must match";
  fp8::check_scales(k_scale, k_cache, "k_scale");
  fp8::check_scales(v_scale, v_cache, "v_scale");
  // the staged k rows: kHeadsPerBlock of them within the default 48 KiB of shared memory
  TVM_FFI_ICHECK(head_dim * kHeadsPerBlock * 4 <= (48 << 10))
      << "head_dim " << head_dim << " is too large for rope_store_kv_fp8 (at most 1536)";
  a.k_cache = data_of<void>(k_cache);
  a.v_cache = data_of<void>(v_cache);
  a.k_scale = data_of<float>(k_scale);
  a.v_scale = data_of<float>(v_scale);
  a.num_slots = k_cache.size(0);
  launch<true>(a, q, "rope_store_kv_fp8");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_kv, freetoken::rope_store_kv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_kv_fp8, freetoken::rope_store_kv_fp8);
