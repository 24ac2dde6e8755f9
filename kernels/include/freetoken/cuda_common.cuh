// Shared helpers for the CUDA kernels (and their HIP builds through kernels/hip/): argument
// checks at the tvm-ffi boundary, float dtype dispatch, 16-byte vectors, warp/block reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include <cstdint>

namespace freetoken {

using tvm::ffi::TensorView;
using bf16 = __nv_bfloat16;
using f16 = __half;

#if defined(__HIP_PLATFORM_AMD__)
constexpr DLDeviceType kGpuDeviceType = kDLROCM;
#else
constexpr DLDeviceType kGpuDeviceType = kDLCUDA;
#endif
constexpr int kWarp = 32;  // gfx11/gfx12 run wave32, like every NVIDIA GPU

// ---------------------------------------------------------------- host-side checks

#define FT_CUDA_CHECK(stmt)                                                              \
  do {                                                                                   \
    cudaError_t ft_err_ = (stmt);                                                        \
    TVM_FFI_ICHECK(ft_err_ == cudaSuccess) << "CUDA error: " << cudaGetErrorString(ft_err_); \
  } while (0)

/*! \brief Raise if the last launch failed (bad configuration, missing kernel image). */
inline void check_launch(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  TVM_FFI_ICHECK(err == cudaSuccess) << kernel << " launch failed: " << cudaGetErrorString(err);
}

enum class FloatType { kF32, kBF16, kF16 };

inline bool has_dtype(const TensorView& t, DLDataTypeCode code, int bits) {
  DLDataType d = t.dtype();
  return d.code == code && d.bits == bits && d.lanes == 1;
}

inline const char* dtype_name(DLDataType d) {
  if (d.lanes != 1) return "vector";
  switch (d.code) {
    case kDLFloat: return d.bits == 32 ? "float32" : d.bits == 16 ? "float16" : "float64";
    case kDLBfloat: return "bfloat16";
    case kDLInt: return d.bits == 64 ? "int64" : d.bits == 32 ? "int32" : "int";
    case kDLUInt: return "uint";
    case kDLBool: return "bool";
    default: return "unknown";
  }
}

inline void check_gpu(const TensorView& t, const char* name, int device_id) {
  DLDevice d = t.device();
  TVM_FFI_ICHECK(d.device_type == kGpuDeviceType)
      << name << " must be a GPU tensor (its DLPack device type is " << d.device_type << ")";
  TVM_FFI_ICHECK(d.device_id == device_id)
      << name << " is on GPU " << d.device_id << " but the other arguments are on GPU "
      << device_id;
}

inline void check_dtype(const TensorView& t, DLDataTypeCode code, int bits, const char* name,
                        const char* wanted) {
  TVM_FFI_ICHECK(has_dtype(t, code, bits))
      << name << " must be " << wanted << ", got " << dtype_name(t.dtype());
}

inline void check_same_dtype(const TensorView& a, const TensorView& b, const char* na,
                             const char* nb) {
  DLDataType x = a.dtype(), y = b.dtype();
  TVM_FFI_ICHECK(x.code == y.code && x.bits == y.bits && x.lanes == y.lanes)
      << na << " (" << dtype_name(x) << ") and " << nb << " (" << dtype_name(y)
      << ") must have the same dtype";
}

inline void check_ndim(const TensorView& t, int ndim, const char* name) {
  TVM_FFI_ICHECK(t.ndim() == ndim) << name << " must have " << ndim << " dims, got " << t.ndim();
}

inline void check_contiguous(const TensorView& t, const char* name) {
  TVM_FFI_ICHECK(t.IsContiguous()) << name << " must be contiguous (call .contiguous())";
}

/*! \brief The float dtype of `t` (float32, bfloat16 or float16); anything else raises. */
inline FloatType float_type(const TensorView& t, const char* name) {
  if (has_dtype(t, kDLFloat, 32)) return FloatType::kF32;
  if (has_dtype(t, kDLBfloat, 16)) return FloatType::kBF16;
  if (has_dtype(t, kDLFloat, 16)) return FloatType::kF16;
  TVM_FFI_ICHECK(false) << name << " must be float32, bfloat16 or float16, got "
                        << dtype_name(t.dtype());
  return FloatType::kF32;
}

template <typename T>
inline T* data_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

inline bool aligned16(const TensorView& t) {
  return reinterpret_cast<uintptr_t>(data_of<char>(t)) % 16 == 0;
}

/*! \brief A tensor seen as `rows` rows of `width` contiguous elements `stride` apart. */
struct RowView {
  int64_t rows;
  int64_t width;
  int64_t stride;
};

/*!
 * \brief View `t` as rows of its last `inner_dims` dims, which must be contiguous; the leading
 * dims must collapse into one row stride (a column slice of a fused projection qualifies).
 */
inline RowView row_view(const TensorView& t, int inner_dims, const char* name) {
  int nd = t.ndim();
  TVM_FFI_ICHECK(nd >= inner_dims && inner_dims >= 1)
      << name << " must have at least " << inner_dims << " dims, got " << nd;
  int64_t width = 1, rows = 1;
  for (int i = nd - inner_dims; i < nd; ++i) width *= t.size(i);
  for (int i = 0; i < nd - inner_dims; ++i) rows *= t.size(i);
  if (t.IsContiguous() || rows <= 1) return {rows, width, width};
  int64_t expected = 1;
  for (int i = nd - 1; i >= nd - inner_dims; --i) {
    TVM_FFI_ICHECK(t.size(i) == 1 || t.stride(i) == expected)
        << name << " must have contiguous rows (its last " << inner_dims << " dims)";
    expected *= t.size(i);
  }
  int64_t row_stride = width, next = -1;  // size-1 dims carry arbitrary strides: skip them
  for (int i = nd - inner_dims - 1; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (next < 0) row_stride = t.stride(i);
    TVM_FFI_ICHECK(next < 0 || t.stride(i) == next)
        << name << ": leading dims must collapse into one row stride (call .contiguous())";
    next = t.stride(i) * t.size(i);
  }
  return {rows, width, row_stride};
}

/*! \brief A [rows, cols] GPU matrix whose rows start on 16-byte boundaries (vector loads). */
inline void check_aligned_rows(const TensorView& t, int device_id, const char* name,
                               int64_t cols) {
  check_gpu(t, name, device_id);
  check_ndim(t, 2, name);
  RowView rv = row_view(t, 1, name);
  TVM_FFI_ICHECK(rv.width == cols) << name << " must have " << cols << " columns, got "
                                   << rv.width;
  TVM_FFI_ICHECK(rv.stride % 8 == 0 && aligned16(t))
      << name << " rows must start on 16-byte boundaries (row stride a multiple of 8)";
}

/*! \brief The stream tvm-ffi holds for the device (torch's current stream, from torch). */
inline cudaStream_t stream_for(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kGpuDeviceType, t.device().device_id));
}

/*! \brief Makes `device_id` current for the scope, so launches land on the tensors' GPU. */
class DeviceGuard {
 public:
  explicit DeviceGuard(int device_id) {
    FT_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_id) FT_CUDA_CHECK(cudaSetDevice(device_id));
    current_ = device_id;
  }
  ~DeviceGuard() {
    if (previous_ != current_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

/*! \brief Run `...` with `T` bound to the device type of a FloatType. */
#define FT_CUDA_DISPATCH_FLOAT(ftype, T, ...)     \
  switch (ftype) {                                \
    case ::freetoken::FloatType::kF32: {          \
      using T = float;                            \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
    case ::freetoken::FloatType::kBF16: {         \
      using T = ::freetoken::bf16;                \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
    case ::freetoken::FloatType::kF16: {          \
      using T = ::freetoken::f16;                 \
      __VA_ARGS__;                                \
      break;                                      \
    }                                             \
  }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/*! \brief The device's SM count, cached (HIP: 64, the gfx1201 part's CU count; only launch
 * sizes depend on it there). */
inline int sm_count(int device) {
#if defined(__HIP_PLATFORM_AMD__)
  (void)device;
  return 64;
#else
  static int cached[64] = {};
  if (device < 0 || device >= 64) return 132;
  if (cached[device] == 0) {
    int n = 0;
    FT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
#endif
}

/*! \brief Whether the device takes programmatic dependent launches: sm_90 or newer (the
 * launch attribute is refused before), never on HIP. */
inline bool has_pdl(int device) {
#if defined(__HIP_PLATFORM_AMD__)
  (void)device;
  return false;
#else
  static int major[64] = {};  // 0: not asked yet
  if (device < 0 || device >= 64) return false;
  if (major[device] == 0) {
    FT_CUDA_CHECK(cudaDeviceGetAttribute(&major[device], cudaDevAttrComputeCapabilityMajor,
                                         device));
  }
  return major[device] >= 9;
#endif
}

/*! \brief kernel<<<grid, block, 0, stream>>>(args...), as a programmatic dependent launch
 * where `pdl` asks for one and the device takes it (the kernel itself then waits for its
 * inputs: gemv_knobs.cuh's wait_for_inputs). */
template <typename... Params, typename... Args>
inline void launch_maybe_pdl(void (*kernel)(Params...), dim3 grid, dim3 block,
                             cudaStream_t stream, bool pdl, int device, Args... args) {
#if !defined(__HIP_PLATFORM_AMD__)
  if (pdl && has_pdl(device)) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    FT_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
    return;
  }
#endif
  kernel<<<grid, block, 0, stream>>>(args...);
}

// ---------------------------------------------------------------- device helpers

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ f16 from_float<f16>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float v) { return __float2bfloat16_rn(v); }

/*! \brief N elements moved as one aligned access (16 bytes when N * sizeof(T) == 16). */
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    float o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  return v;
}

#if !defined(__HIP_PLATFORM_AMD__)
// ---------------------------------------------------------------- sm_80+ tensor-core helpers
// Fragment layouts follow the PTX ISA for mma.m16n8k16 (row.col) and ldmatrix.m8n8.

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/*! \brief Async 16-byte global->shared copy; zero-fills the destination when !valid. */
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
               "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

/*! \brief c += a * b for one m16n8k16 tile with f32 accumulation (T = bf16 or f16). */
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&c)[4], const uint32_t (&a)[4],
                                                uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<f16>(float (&c)[4], const uint32_t (&a)[4],
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/*! \brief Two floats rounded to T and packed low-first into 32 bits (an mma operand pair). */
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<bf16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<f16>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
#endif  // !__HIP_PLATFORM_AMD__

}  // namespace freetoken
