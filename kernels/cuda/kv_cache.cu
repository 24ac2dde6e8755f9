// Store K and V rows into the paged pool: cache[slot_mapping[t]] = k[t]; a negative slot (a
// padding token) is skipped. One block per token, 16-byte vectors where the layout allows.
// store_kv_fp8 quantizes the rows into the FP8 pool instead (freetoken/fp8_encode.h): one warp
// per (token, KV head) row finds its largest magnitude, then writes the row's e4m3 codes.
#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_kv.cuh"

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

constexpr int kFp8RowsPerBlock = 4;  // one warp per row

// Grid: (tokens, ceil(2 * heads / kFp8RowsPerBlock)); rows [0, heads) are k's, the rest v's.
template <typename T>
__global__ void __launch_bounds__(kFp8RowsPerBlock * kWarp)
    store_kv_fp8_kernel(const T* __restrict__ k, const T* __restrict__ v,
                        uint8_t* __restrict__ k_cache, uint8_t* __restrict__ v_cache,
                        float* __restrict__ k_scale, float* __restrict__ v_scale,
                        const int64_t* __restrict__ slot_mapping, KvShape s) {
  int64_t t = blockIdx.x;
  int64_t slot = slot_mapping[t];
  int r = blockIdx.y * kFp8RowsPerBlock + threadIdx.x / kWarp;
  if (slot < 0 || slot >= s.slots || r >= 2 * s.heads) return;  // whole warps leave together
  bool is_k = r < s.heads;
  int h = is_k ? r : r - s.heads;
  int64_t row = slot * s.heads + h;  // the (slot, head) row of the codes and the scales
  const T* src = is_k ? k + t * s.k_token_stride + h * s.k_head_stride
                      : v + t * s.v_token_stride + h * s.v_head_stride;
  fp8::store_row<T>(src, (is_k ? k_cache : v_cache) + row * s.head_dim,
                   (is_k ? k_scale : v_scale) + row, s.head_dim, threadIdx.x % kWarp);
}

// What both stores check (the pools' dtypes are the caller's): one GPU, k and v rows [T, Hk, D]
// beside pools [S, Hk, D], slot_mapping int64 [T]. Their shape and strides, and T.
KvShape check_store(const TensorView& k, const TensorView& v, const TensorView& k_cache,
                    const TensorView& v_cache, const TensorView& slot_mapping, int64_t* tokens) {
  int dev = k.device().device_id;
  check_gpu(k, "k", dev);
  check_gpu(v, "v", dev);
  check_gpu(k_cache, "k_cache", dev);
  check_gpu(v_cache, "v_cache", dev);
  check_gpu(slot_mapping, "slot_mapping", dev);
  check_dtype(slot_mapping, kDLInt, 64, "slot_mapping", "int64");
  check_ndim(k_cache, 3, "k_cache");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  int64_t slots = k_cache.size(0), heads = k_cache.size(1), head_dim = k_cache.size(2);
  check_rows(v_cache, "v_cache", slots, heads, head_dim);
  TVM_FFI_ICHECK(slot_mapping.ndim() == 1 && slot_mapping.IsContiguous())
      << "slot_mapping must be a contiguous 1-D tensor";
  *tokens = slot_mapping.size(0);
  check_rows(k, "k", *tokens, heads, head_dim);
  check_rows(v, "v", *tokens, heads, head_dim);
  return KvShape{slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 static_cast<int>(heads), static_cast<int>(head_dim)};
}

/*! \brief k_cache[slot_mapping[t]] = k[t], v likewise; k [T, Hk, D], caches [S, Hk, D]. */
void store_kv(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
              TensorView slot_mapping) {
  FloatType ft = float_type(k_cache, "k_cache");
  check_same_dtype(v_cache, k_cache, "v_cache", "k_cache");
  check_same_dtype(k, k_cache, "k", "k_cache");
  check_same_dtype(v, k_cache, "v", "k_cache");
  int64_t tokens;
  KvShape s = check_store(k, v, k_cache, v_cache, slot_mapping, &tokens);
  if (tokens == 0 || s.heads * s.head_dim == 0) return;
  DeviceGuard guard(k.device().device_id);
  const int64_t head_dim = s.head_dim;
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

/*!
 * \brief Quantize k[t] and v[t] into the FP8 pool at slot_mapping[t] (negative: skipped);
 * k, v [T, Hk, D] float32/bfloat16/float16 (rows may be strided), caches uint8 [S, Hk, D] of
 * e4m3 codes, scales float32 [S, Hk].
 */
void store_kv_fp8(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
                  TensorView k_scale, TensorView v_scale, TensorView slot_mapping) {
  FloatType ft = float_type(k, "k");
  check_same_dtype(v, k, "v", "k");
  check_dtype(k_cache, kDLUInt, 8, "k_cache", "uint8 (e4m3 codes)");
  check_dtype(v_cache, kDLUInt, 8, "v_cache", "uint8 (e4m3 codes)");
  int64_t tokens;
  KvShape s = check_store(k, v, k_cache, v_cache, slot_mapping, &tokens);
  fp8::check_scales(k_scale, k_cache, "k_scale");
  fp8::check_scales(v_scale, k_cache, "v_scale");
  const int64_t heads = s.heads;
  if (tokens == 0 || heads * s.head_dim == 0) return;
  DeviceGuard guard(k.device().device_id);
  dim3 grid(static_cast<unsigned>(tokens),
            static_cast<unsigned>(ceil_div(2 * heads, kFp8RowsPerBlock)));
  cudaStream_t stream = stream_for(k);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    store_kv_fp8_kernel<T><<<grid, kFp8RowsPerBlock * kWarp, 0, stream>>>(
        data_of<T>(k), data_of<T>(v), data_of<uint8_t>(k_cache), data_of<uint8_t>(v_cache),
        data_of<float>(k_scale), data_of<float>(v_scale), data_of<int64_t>(slot_mapping), s);
  });
  check_launch("store_kv_fp8");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv, freetoken::store_kv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv_fp8, freetoken::store_kv_fp8);
