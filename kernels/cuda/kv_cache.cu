// Store K and V rows into the paged pool: cache[slot_mapping[t]] = k[t]; a negative slot (a
// padding token) is skipped. One block per token, 16-byte vectors where the layout allows.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

struct KvShape {
  int64_t slots, k_token_stride, k_head_stride, v_token_stride, v_head_stride;
  int heads, head_dim;
};

template <typename T, int VEC>
__global__ void store_kv_kernel(const T* __restrict__ k, const T* __restrict__ v,
                                T* __restrict__ k_cache, T* __restrict__ v_cache,
                                const int64_t* __restrict__ slot_mapping, KvShape s) {
  int64_t t = blockIdx.x;
  int64_t slot = slot_mapping[t];
  if (slot < 0 || slot >= s.slots) return;
  int per_head = s.head_dim / VEC;
  int64_t row = static_cast<int64_t>(s.heads) * s.head_dim;
  for (int i = threadIdx.x; i < s.heads * per_head; i += blockDim.x) {
    int h = i / per_head, d = (i - h * per_head) * VEC;
    int64_t dst = slot * row + static_cast<int64_t>(h) * s.head_dim + d;
    store_vec<T, VEC>(k_cache + dst,
                      load_vec<T, VEC>(k + t * s.k_token_stride + h * s.k_head_stride + d));
    store_vec<T, VEC>(v_cache + dst,
                      load_vec<T, VEC>(v + t * s.v_token_stride + h * s.v_head_stride + d));
  }
}

void check_rows(const TensorView& t, const char* name, int64_t tokens, int64_t heads,
                int64_t head_dim) {
  check_ndim(t, 3, name);
  TVM_FFI_ICHECK(t.size(0) == tokens && t.size(1) == heads && t.size(2) == head_dim)
      << name << " must be [" << tokens << ", " << heads << ", " << head_dim << "]";
  TVM_FFI_ICHECK(t.size(2) <= 1 || t.stride(2) == 1) << name << "'s last dim must be contiguous";
}

/*! \brief k_cache[slot_mapping[t]] = k[t], v likewise; k [T, Hk, D], caches [S, Hk, D]. */
void store_kv(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
              TensorView slot_mapping) {
  int dev = k.device().device_id;
  check_gpu(k, "k", dev);
  check_gpu(v, "v", dev);
  check_gpu(k_cache, "k_cache", dev);
  check_gpu(v_cache, "v_cache", dev);
  check_gpu(slot_mapping, "slot_mapping", dev);
  FloatType ft = float_type(k_cache, "k_cache");
  check_same_dtype(v_cache, k_cache, "v_cache", "k_cache");
  check_same_dtype(k, k_cache, "k", "k_cache");
  check_same_dtype(v, k_cache, "v", "k_cache");
  check_dtype(slot_mapping, kDLInt, 64, "slot_mapping", "int64");
  check_ndim(k_cache, 3, "k_cache");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  int64_t slots = k_cache.size(0), heads = k_cache.size(1), head_dim = k_cache.size(2);
  check_rows(v_cache, "v_cache", slots, heads, head_dim);
  TVM_FFI_ICHECK(slot_mapping.ndim() == 1 && slot_mapping.IsContiguous())
      << "slot_mapping must be a contiguous 1-D tensor";
  int64_t tokens = slot_mapping.size(0);
  check_rows(k, "k", tokens, heads, head_dim);
  check_rows(v, "v", tokens, heads, head_dim);
  if (tokens == 0 || heads * head_dim == 0) return;
  DeviceGuard guard(dev);
  KvShape s{slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            static_cast<int>(heads), static_cast<int>(head_dim)};
  int64_t vec = ft == FloatType::kF32 ? 4 : 8;
  bool vec_ok = head_dim % vec == 0 && s.k_token_stride % vec == 0 &&
                s.k_head_stride % vec == 0 && s.v_token_stride % vec == 0 &&
                s.v_head_stride % vec == 0 && aligned16(k) && aligned16(v) &&
                aligned16(k_cache) && aligned16(v_cache);
  cudaStream_t stream = stream_for(k);
  int threads = 128;
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (vec_ok) {
      store_kv_kernel<T, 16 / sizeof(T)><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
          data_of<T>(k), data_of<T>(v), data_of<T>(k_cache), data_of<T>(v_cache),
          data_of<int64_t>(slot_mapping), s);
    } else {
      store_kv_kernel<T, 1><<<static_cast<unsigned>(tokens), threads, 0, stream>>>(
          data_of<T>(k), data_of<T>(v), data_of<T>(k_cache), data_of<T>(v_cache),
          data_of<int64_t>(slot_mapping), s);
    }
  });
  check_launch("store_kv");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv, freetoken::store_kv);
