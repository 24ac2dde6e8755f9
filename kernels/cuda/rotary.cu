// Rotary position embedding in place on q and k, neox (halves) or interleaved (pairs) layout,
// rotating the first rot_dim of each head. One block per token; f32 math.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

struct RotaryShape {
  int64_t tokens, max_pos, q_stride, k_stride;
  int q_heads, k_heads, head_dim, rot_dim;
  bool neox;
};

template <typename T>
__global__ void rotary_kernel(const int64_t* __restrict__ positions, T* __restrict__ q,
                              T* __restrict__ k, const float* __restrict__ cos_sin,
                              RotaryShape s) {
  int64_t t = blockIdx.x;
  int64_t pos = positions[t];
  if (pos < 0 || pos >= s.max_pos) return;  // out of the table: leave the token unrotated
  int half = s.rot_dim / 2;
  const float* cos = cos_sin + pos * s.rot_dim;
  const float* sin = cos + half;
  int pairs = (s.q_heads + s.k_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    int head = i / half, j = i % half;
    T* base = head < s.q_heads ? q + t * s.q_stride + static_cast<int64_t>(head) * s.head_dim
                               : k + t * s.k_stride +
                                     static_cast<int64_t>(head - s.q_heads) * s.head_dim;
    int a = s.neox ? j : 2 * j;
    int b = s.neox ? j + half : 2 * j + 1;
    float x1 = to_float(base[a]), x2 = to_float(base[b]);
    float c = cos[j], sn = sin[j];
    base[a] = from_float<T>(x1 * c - x2 * sn);
    base[b] = from_float<T>(x2 * c + x1 * sn);
  }
}

// Heads of a [T, H*D] or [T, H, D] tensor whose rows hold H*D contiguous elements.
int heads_of(const TensorView& t, int64_t head_dim, const char* name, int64_t* token_stride) {
  RowView rv = row_view(t, t.ndim() - 1, name);
  TVM_FFI_ICHECK(rv.width % head_dim == 0)
      << name << " rows hold " << rv.width << " elements, not a multiple of head_dim "
      << head_dim;
  *token_stride = rv.stride;
  return static_cast<int>(rv.width / head_dim);
}

/*! \brief Rotate q [T, Hq*D] and k [T, Hk*D] in place by cos_sin_cache[positions]. */
void rotary_embedding(TensorView positions, TensorView q, TensorView k, TensorView cos_sin_cache,
                      int64_t head_dim, bool is_neox) {
  int dev = q.device().device_id;
  check_gpu(positions, "positions", dev);
  check_gpu(q, "q", dev);
  check_gpu(k, "k", dev);
  check_gpu(cos_sin_cache, "cos_sin_cache", dev);
  check_dtype(positions, kDLInt, 64, "positions", "int64");
  check_dtype(cos_sin_cache, kDLFloat, 32, "cos_sin_cache", "float32");
  FloatType ft = float_type(q, "q");
  check_same_dtype(k, q, "k", "q");
  TVM_FFI_ICHECK(positions.ndim() == 1 && positions.IsContiguous())
      << "positions must be a contiguous 1-D tensor";
  TVM_FFI_ICHECK(cos_sin_cache.ndim() == 2 && cos_sin_cache.IsContiguous())
      << "cos_sin_cache must be a contiguous [max_pos, rot_dim] tensor";
  TVM_FFI_ICHECK(q.ndim() >= 2 && k.ndim() >= 2 && q.size(0) == positions.size(0) &&
                 k.size(0) == positions.size(0))
      << "q and k must be [T, H*D] with T = len(positions) = " << positions.size(0);
  int64_t rot = cos_sin_cache.size(1);
  TVM_FFI_ICHECK(head_dim > 0 && rot % 2 == 0 && rot > 0 && rot <= head_dim)
      << "cos_sin_cache's rot_dim " << rot << " must be even and at most head_dim " << head_dim;
  RotaryShape s{positions.size(0), cos_sin_cache.size(0), 0, 0, 0, 0,
                static_cast<int>(head_dim), static_cast<int>(rot), is_neox};
  s.q_heads = heads_of(q, head_dim, "q", &s.q_stride);
  s.k_heads = heads_of(k, head_dim, "k", &s.k_stride);
  int pairs = (s.q_heads + s.k_heads) * static_cast<int>(rot / 2);
  if (s.tokens == 0 || pairs == 0) return;
  DeviceGuard guard(dev);
  int threads = pairs >= 256 ? 256 : static_cast<int>(ceil_div(pairs, kWarp)) * kWarp;
  cudaStream_t stream = stream_for(q);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    rotary_kernel<T><<<static_cast<unsigned>(s.tokens), threads, 0, stream>>>(
        data_of<int64_t>(positions), data_of<T>(q), data_of<T>(k), data_of<float>(cos_sin_cache),
        s);
  });
  check_launch("rotary_embedding");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rotary_embedding, freetoken::rotary_embedding);
