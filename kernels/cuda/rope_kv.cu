// After the QKV projection, in one launch: the optional per-head q/k RMSNorm, rotary embedding
// of q (in place) and k, and the store of k and v into the paged pool (k rotated). One block per
// token, one warp per head. Values are rounded to the dtype where the unfused chain
// (rms_norm -> rotary_embedding -> store_kv) stores them, so the results are identical to it.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

constexpr int kHeadsPerBlock = 8;

struct RopeKvArgs {
  const int64_t* positions;
  const int64_t* slots;
  void* q;
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
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

template <typename T>
__global__ void rope_store_kv_kernel(RopeKvArgs a) {
  int64_t t = blockIdx.x;
  int64_t pos = a.positions[t], slot = a.slots[t];
  // out of the table: unrotated, as rotary_embedding leaves it
  const float* cos = pos >= 0 && pos < a.max_pos ? a.cos_sin + pos * a.rot_dim : nullptr;
  bool store = slot >= 0 && slot < a.num_slots;
  int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  int heads = a.q_heads + 2 * a.kv_heads;
  int64_t kv_row = static_cast<int64_t>(a.kv_heads) * a.head_dim;
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
      T* dst = static_cast<T*>(a.k_cache) + slot * kv_row + static_cast<int64_t>(kh) * a.head_dim;
      rope_head<T>(src, dst, static_cast<const T*>(a.k_norm), cos, lane, a);
    } else if (store) {
      int vh = h - a.q_heads - a.kv_heads;
      const T* src = static_cast<const T*>(a.v) + t * a.v_stride +
                     static_cast<int64_t>(vh) * a.head_dim;
      T* dst = static_cast<T*>(a.v_cache) + slot * kv_row + static_cast<int64_t>(vh) * a.head_dim;
      for (int d = lane; d < a.head_dim; d += kWarp) dst[d] = src[d];
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

void check_cache(const TensorView& c, const TensorView& q, int64_t kv_heads, int64_t head_dim,
                 const char* name) {
  check_gpu(c, name, q.device().device_id);
  check_same_dtype(c, q, name, "q");
  check_contiguous(c, name);
  TVM_FFI_ICHECK(c.ndim() == 3 && c.size(1) == kv_heads && c.size(2) == head_dim)
      << name << " must be [S, " << kv_heads << ", " << head_dim << "]";
}

/*! \brief q/k norm (optional, per head) + rope on q (in place) and k, k and v into the pool. */
void rope_store_kv(TensorView positions, TensorView q, TensorView k, TensorView v,
                   TensorView cos_sin_cache, TensorView k_cache, TensorView v_cache,
                   TensorView slot_mapping, tvm::ffi::Optional<TensorView> q_norm,
                   tvm::ffi::Optional<TensorView> k_norm, double eps, int64_t head_dim,
                   bool is_neox) {
  int dev = q.device().device_id;
  for (const TensorView* t : {&positions, &k, &v, &cos_sin_cache, &slot_mapping}) {
    check_gpu(*t, "every argument", dev);
  }
  FloatType ft = float_type(q, "q");
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
  RopeKvArgs a{data_of<int64_t>(positions), data_of<int64_t>(slot_mapping), data_of<void>(q),
               data_of<void>(k), data_of<void>(v), data_of<void>(k_cache),
               data_of<void>(v_cache), data_of<float>(cos_sin_cache),
               norm_of(q_norm, q, head_dim, "q_norm"), norm_of(k_norm, q, head_dim, "k_norm"),
               0, 0, 0, cos_sin_cache.size(0), k_cache.size(0), 0, 0,
               static_cast<int>(head_dim), static_cast<int>(rot), static_cast<float>(eps),
               is_neox};
  a.q_heads = heads_of(q, tokens, head_dim, "q", &a.q_stride);
  a.kv_heads = heads_of(k, tokens, head_dim, "k", &a.k_stride);
  TVM_FFI_ICHECK(heads_of(v, tokens, head_dim, "v", &a.v_stride) == a.kv_heads)
      << "k and v must have the same number of heads";
  check_cache(k_cache, q, a.kv_heads, head_dim, "k_cache");
  check_cache(v_cache, q, a.kv_heads, head_dim, "v_cache");
  TVM_FFI_ICHECK(v_cache.size(0) == k_cache.size(0)) << "k_cache and v_cache must match";
  if (tokens == 0) return;
  DeviceGuard guard(dev);
  int heads = a.q_heads + 2 * a.kv_heads;
  dim3 grid(static_cast<unsigned>(tokens),
            static_cast<unsigned>(ceil_div(heads, kHeadsPerBlock)));
  cudaStream_t stream = stream_for(q);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    rope_store_kv_kernel<T><<<grid, kHeadsPerBlock * kWarp, 0, stream>>>(a);
  });
  check_launch("rope_store_kv");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_store_kv, freetoken::rope_store_kv);
