// RMSNorm: plain, fused with the residual add, and gated (the Gated DeltaNet output norm,
// per head, times silu of the gate). One group of threads per row (several rows per block for
// narrow rows), 16-byte vectors where the layout allows, f32 accumulation.
#include "freetoken/cuda_common.cuh"
#include "freetoken/gdn_math.h"

namespace freetoken {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kRowsPerBlockMax = 8;  // narrow rows share a block of up to 256 threads

// Sum of `v` over the threads of this row (threadIdx.y); blockDim.x is a multiple of 32.
__device__ __forceinline__ float row_sum(float v, float (*partial)[kWarp]) {
  v = warp_sum(v);
  if (threadIdx.x % kWarp == 0) partial[threadIdx.y][threadIdx.x / kWarp] = v;
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < static_cast<int>(blockDim.x / kWarp); ++i) total += partial[threadIdx.y][i];
  return total;
}

// This thread's share of sum(x^2) over a row of nvec vectors (0 for an inactive row).
template <typename T, int VEC>
__device__ __forceinline__ float sum_squares(const T* xr, int nvec, bool active) {
  float ss = 0.f;
  for (int i = threadIdx.x; active && i < nvec; i += blockDim.x) {
    Vec<T, VEC> v = load_vec<T, VEC>(xr + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float f = to_float(v.v[e]);
      ss += f * f;
    }
  }
  return ss;
}

template <typename T, int VEC>
__global__ void rms_norm_kernel(T* out, const T* x, const T* __restrict__ weight, int64_t rows,
                                int nvec, int64_t x_stride, int64_t out_stride, float eps,
                                float inv_width) {
  __shared__ float partial[kRowsPerBlockMax][kWarp];
  int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  bool active = row < rows;  // inactive threads still join the reduction's barrier
  const T* xr = x + (active ? row : 0) * x_stride;
  float inv = rsqrtf(row_sum(sum_squares<T, VEC>(xr, nvec, active), partial) * inv_width + eps);
  if (!active) return;
  T* orow = out + row * out_stride;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec<T, VEC> v = load_vec<T, VEC>(xr + i * VEC);
    Vec<T, VEC> w = load_vec<T, VEC>(weight + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v.v[e] = from_float<T>(to_float(v.v[e]) * inv * to_float(w.v[e]));
    store_vec<T, VEC>(orow + i * VEC, v);
  }
}

template <typename T, int VEC>
__global__ void fused_add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual,
                                          const T* __restrict__ weight, int64_t rows, int nvec,
                                          int64_t x_stride, int64_t r_stride, float eps,
                                          float inv_width) {
  __shared__ float partial[kRowsPerBlockMax][kWarp];
  int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  bool active = row < rows;
  T* xr = x + (active ? row : 0) * x_stride;
  T* rr = residual + (active ? row : 0) * r_stride;
  float ss = 0.f;
  for (int i = threadIdx.x; active && i < nvec; i += blockDim.x) {
    Vec<T, VEC> a = load_vec<T, VEC>(xr + i * VEC);
    Vec<T, VEC> r = load_vec<T, VEC>(rr + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      r.v[e] = from_float<T>(to_float(a.v[e]) + to_float(r.v[e]));  // rounded like the stored sum
      float f = to_float(r.v[e]);
      ss += f * f;
    }
    store_vec<T, VEC>(rr + i * VEC, r);
  }
  float inv = rsqrtf(row_sum(ss, partial) * inv_width + eps);
  if (!active) return;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec<T, VEC> r = load_vec<T, VEC>(rr + i * VEC);  // this thread's own store above
    Vec<T, VEC> w = load_vec<T, VEC>(weight + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) r.v[e] = from_float<T>(to_float(r.v[e]) * inv * to_float(w.v[e]));
    store_vec<T, VEC>(xr + i * VEC, r);
  }
}

// Rows are (token, group) pairs: each token's row of x holds `groups` groups of the weight's
// width, normed apart. out = round(round(x / rms * w) * silu(z)): the norm is rounded where the
// unfused rms_norm stores it, silu(z) stays f32 (as the reference gated norm computes it).
// out may alias x: every thread reads its elements before writing them, after the reduction.
template <typename T, int VEC>
__global__ void rms_norm_gated_kernel(T* out, const T* x, const T* z, const T* __restrict__ weight,
                                      int64_t rows, int groups, int nvec, int64_t x_stride,
                                      int64_t z_stride, int64_t out_stride, float eps,
                                      float inv_width) {
  __shared__ float partial[kRowsPerBlockMax][kWarp];
  int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  bool active = row < rows;
  int64_t token = active ? row / groups : 0;
  int64_t col = (active ? row % groups : 0) * static_cast<int64_t>(nvec) * VEC;
  const T* xr = x + token * x_stride + col;
  float inv = rsqrtf(row_sum(sum_squares<T, VEC>(xr, nvec, active), partial) * inv_width + eps);
  if (!active) return;
  const T* zr = z + token * z_stride + col;
  T* orow = out + token * out_stride + col;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    Vec<T, VEC> v = load_vec<T, VEC>(xr + i * VEC);
    Vec<T, VEC> w = load_vec<T, VEC>(weight + i * VEC);
    Vec<T, VEC> g = load_vec<T, VEC>(zr + i * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float normed = to_float(from_float<T>(to_float(v.v[e]) * inv * to_float(w.v[e])));
      v.v[e] = from_float<T>(normed * gdn::silu(to_float(g.v[e])));
    }
    store_vec<T, VEC>(orow + i * VEC, v);
  }
}

// Threads per row: enough 32-wide warps to cover the row's vectors once (up to 1024).
dim3 norm_block(int nvec) {
  int per_row = static_cast<int>(ceil_div(nvec, kWarp)) * kWarp;
  per_row = per_row < kMaxThreads ? per_row : kMaxThreads;
  int rows = 256 / per_row;
  rows = rows < 1 ? 1 : (rows > kRowsPerBlockMax ? kRowsPerBlockMax : rows);
  return dim3(per_row, rows);
}

struct NormArgs {
  void* a;  // out (plain) or x (fused)
  void* b;  // x (plain) or residual (fused)
  const void* weight;
  RowView ra, rb;
  float eps;
  bool fused;
  cudaStream_t stream;
};

template <typename T, int VEC>
void launch_norm(const NormArgs& p) {
  int nvec = static_cast<int>(p.ra.width / VEC);
  dim3 block = norm_block(nvec);
  dim3 grid(static_cast<unsigned>(ceil_div(p.ra.rows, block.y)));
  float inv_width = 1.f / static_cast<float>(p.ra.width);
  if (p.fused) {
    fused_add_rms_norm_kernel<T, VEC><<<grid, block, 0, p.stream>>>(
        static_cast<T*>(p.a), static_cast<T*>(p.b), static_cast<const T*>(p.weight), p.ra.rows,
        nvec, p.ra.stride, p.rb.stride, p.eps, inv_width);
    check_launch("fused_add_rms_norm");
  } else {
    rms_norm_kernel<T, VEC><<<grid, block, 0, p.stream>>>(
        static_cast<T*>(p.a), static_cast<const T*>(p.b), static_cast<const T*>(p.weight),
        p.ra.rows, nvec, p.rb.stride, p.ra.stride, p.eps, inv_width);
    check_launch("rms_norm");
  }
}

template <typename T>
void dispatch_vec(const NormArgs& p, bool vec_ok) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec_ok) {
    launch_norm<T, kVec>(p);
  } else {
    launch_norm<T, 1>(p);
  }
}

// Checks shared by both entry points; `a` is written, `b` read (and written when fused).
void run_norm(TensorView a, TensorView b, TensorView weight, double eps, bool fused,
              const char* na, const char* nb) {
  int dev = b.device().device_id;
  check_gpu(a, na, dev);
  check_gpu(b, nb, dev);
  check_gpu(weight, "weight", dev);
  FloatType ft = float_type(b, nb);
  check_same_dtype(a, b, na, nb);
  check_same_dtype(weight, b, "weight", nb);
  RowView ra = row_view(a, 1, na), rb = row_view(b, 1, nb);
  TVM_FFI_ICHECK(ra.rows == rb.rows && ra.width == rb.width)
      << na << " and " << nb << " must have the same shape";
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) == rb.width && weight.IsContiguous())
      << "weight must be a contiguous [" << rb.width << "] tensor (the last dim of " << nb << ")";
  if (ra.rows == 0 || ra.width == 0) return;
  DeviceGuard guard(dev);
  NormArgs p{data_of<void>(a), data_of<void>(b), data_of<void>(weight), ra, rb,
             static_cast<float>(eps), fused, stream_for(b)};
  int64_t vec = ft == FloatType::kF32 ? 4 : 8;
  bool vec_ok = ra.width % vec == 0 && ra.stride % vec == 0 && rb.stride % vec == 0 &&
                aligned16(a) && aligned16(b) && aligned16(weight);
  FT_CUDA_DISPATCH_FLOAT(ft, T, dispatch_vec<T>(p, vec_ok));
}

/*! \brief out[T, D] = x / rms(x) * weight (rows of x and out may be strided). */
void rms_norm(TensorView out, TensorView x, TensorView weight, double eps) {
  run_norm(out, x, weight, eps, false, "out", "x");
}

/*! \brief In place: residual += x; x = rms_norm(residual) * weight. */
void fused_add_rms_norm(TensorView x, TensorView residual, TensorView weight, double eps) {
  run_norm(x, residual, weight, eps, true, "x", "residual");
}

struct GatedArgs {
  void* out;
  const void* x;
  const void* z;
  const void* weight;
  RowView ro, rx, rz;
  int64_t group;
  float eps;
  cudaStream_t stream;
};

template <typename T, int VEC>
void launch_gated(const GatedArgs& p) {
  int nvec = static_cast<int>(p.group / VEC);
  int groups = static_cast<int>(p.rx.width / p.group);
  int64_t rows = p.rx.rows * groups;
  dim3 block = norm_block(nvec);
  dim3 grid(static_cast<unsigned>(ceil_div(rows, block.y)));
  rms_norm_gated_kernel<T, VEC><<<grid, block, 0, p.stream>>>(
      static_cast<T*>(p.out), static_cast<const T*>(p.x), static_cast<const T*>(p.z),
      static_cast<const T*>(p.weight), rows, groups, nvec, p.rx.stride, p.rz.stride, p.ro.stride,
      p.eps, 1.f / static_cast<float>(p.group));
  check_launch("rms_norm_gated");
}

template <typename T>
void dispatch_gated(const GatedArgs& p, bool vec_ok) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec_ok) {
    launch_gated<T, kVec>(p);
  } else {
    launch_gated<T, 1>(p);
  }
}

/*! \brief out = rms_norm(x) * weight * silu(z), normed over each weight-wide group of a row
 *  (out, x, z [T, W], W a multiple of the weight's width G; out may be x). */
void rms_norm_gated(TensorView out, TensorView x, TensorView z, TensorView weight, double eps) {
  int dev = x.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(z, "z", dev);
  check_gpu(weight, "weight", dev);
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_dtype(z, x, "z", "x");
  check_same_dtype(weight, x, "weight", "x");
  TVM_FFI_ICHECK(out.ndim() == 2 && x.ndim() == 2 && z.ndim() == 2)
      << "out, x and z must be [T, W] tensors";
  RowView ro = row_view(out, 1, "out"), rx = row_view(x, 1, "x"), rz = row_view(z, 1, "z");
  TVM_FFI_ICHECK(ro.rows == rx.rows && rz.rows == rx.rows && ro.width == rx.width &&
                 rz.width == rx.width)
      << "out, x and z must have the same shape";
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.IsContiguous() && weight.size(0) > 0 &&
                 rx.width % weight.size(0) == 0)
      << "weight must be a contiguous [G] tensor whose width G divides the rows' " << rx.width;
  if (rx.rows == 0 || rx.width == 0) return;
  DeviceGuard guard(dev);
  GatedArgs p{data_of<void>(out), data_of<void>(x), data_of<void>(z), data_of<void>(weight),
              ro, rx, rz, weight.size(0), static_cast<float>(eps), stream_for(x)};
  int64_t vec = ft == FloatType::kF32 ? 4 : 8;
  bool vec_ok = p.group % vec == 0 && ro.stride % vec == 0 && rx.stride % vec == 0 &&
                rz.stride % vec == 0 && aligned16(out) && aligned16(x) && aligned16(z) &&
                aligned16(weight);
  FT_CUDA_DISPATCH_FLOAT(ft, T, dispatch_gated<T>(p, vec_ok));
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rms_norm, freetoken::rms_norm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rms_norm, freetoken::fused_add_rms_norm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rms_norm_gated, freetoken::rms_norm_gated);
