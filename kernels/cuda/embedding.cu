// Embedding gather: out[t] = table[ids[t]]. One block per token, 16-byte vectors where the
// layout allows. An id outside the table writes a zero row: raising would need a device->host
// sync, which CUDA-graph capture forbids (the CPU kernel raises).
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

template <typename T, int VEC>
__global__ void embedding_kernel(T* __restrict__ out, const int64_t* __restrict__ ids,
                                 const T* __restrict__ table, int64_t vocab, int64_t nvec,
                                 int64_t out_stride, int64_t table_stride) {
  int64_t t = blockIdx.x;
  int64_t id = ids[t];
  bool valid = id >= 0 && id < vocab;
  const T* src = table + (valid ? id : 0) * table_stride;
  T* dst = out + t * out_stride;
  Vec<T, VEC> zero;
#pragma unroll
  for (int e = 0; e < VEC; ++e) zero.v[e] = from_float<T>(0.f);
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
    store_vec<T, VEC>(dst + i * VEC, valid ? load_vec<T, VEC>(src + i * VEC) : zero);
  }
}

/*! \brief out[T, D] = table[ids]; ids int64 [T], table [V, D] (rows contiguous). */
void embedding(TensorView out, TensorView ids, TensorView table) {
  int dev = table.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(ids, "ids", dev);
  check_gpu(table, "table", dev);
  FloatType ft = float_type(table, "table");
  check_same_dtype(out, table, "out", "table");
  check_dtype(ids, kDLInt, 64, "ids", "int64");
  TVM_FFI_ICHECK(ids.ndim() == 1 && ids.IsContiguous()) << "ids must be a contiguous 1-D tensor";
  check_ndim(table, 2, "table");
  check_ndim(out, 2, "out");
  RowView rt = row_view(table, 1, "table"), ro = row_view(out, 1, "out");
  TVM_FFI_ICHECK(ro.rows == ids.size(0) && ro.width == rt.width)
      << "out must be [" << ids.size(0) << ", " << rt.width << "] (len(ids), table's width)";
  if (ro.rows == 0 || ro.width == 0) return;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(table);
  int64_t vec = ft == FloatType::kF32 ? 4 : 8;
  bool vec_ok = ro.width % vec == 0 && ro.stride % vec == 0 && rt.stride % vec == 0 &&
                aligned16(out) && aligned16(table);
  int threads = 128;
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if (vec_ok) {
      constexpr int kVec = 16 / sizeof(T);
      embedding_kernel<T, kVec><<<static_cast<unsigned>(ro.rows), threads, 0, stream>>>(
          data_of<T>(out), data_of<int64_t>(ids), data_of<T>(table), rt.rows, ro.width / kVec,
          ro.stride, rt.stride);
    } else {
      embedding_kernel<T, 1><<<static_cast<unsigned>(ro.rows), threads, 0, stream>>>(
          data_of<T>(out), data_of<int64_t>(ids), data_of<T>(table), rt.rows, ro.width,
          ro.stride, rt.stride);
    }
  });
  check_launch("embedding");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(embedding, freetoken::embedding);
