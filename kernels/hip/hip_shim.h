// The CUDA names the kernels use, mapped to HIP for clang's `-x hip -nogpulib -nogpuinc`
// builds (no ROCm install on the build machines). Device intrinsics lower to amdgcn builtins,
// never to __ocml_* device-library calls; host API functions are declared only and resolve
// against libamdhip64 when the .so is loaded on a ROCm machine.
#pragma once

#if !defined(__HIP__)
#error "kernels/hip/ holds the HIP shim: compile with clang -x hip"
#endif

#include <cstddef>
#include <cstdint>

#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((amdgpu_flat_work_group_size(1, 1024)))

// ---------------------------------------------------------------- launch geometry

struct dim3 {
  unsigned int x, y, z;
  constexpr __host__ __device__ dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

namespace freetoken_hip {
// Code object v5 implicit kernel arguments: block counts (u32) then group sizes (u16).
__device__ inline const uint32_t* implicit_u32() {
  return (const uint32_t*)__builtin_amdgcn_implicitarg_ptr();
}
__device__ inline const uint16_t* implicit_u16() {
  return (const uint16_t*)__builtin_amdgcn_implicitarg_ptr();
}
}  // namespace freetoken_hip

#define FT_HIP_AXIS_STRUCT(Name, GX, GY, GZ)                           \
  struct Name {                                                         \
    __declspec(property(get = get_x)) unsigned int x;                   \
    __declspec(property(get = get_y)) unsigned int y;                   \
    __declspec(property(get = get_z)) unsigned int z;                   \
    static __device__ inline unsigned int get_x() { return GX; }       \
    static __device__ inline unsigned int get_y() { return GY; }       \
    static __device__ inline unsigned int get_z() { return GZ; }       \
  };                                                                    \
  extern const __device__ __attribute__((weak)) Name

FT_HIP_AXIS_STRUCT(ft_hip_thread_idx, __builtin_amdgcn_workitem_id_x(),
                   __builtin_amdgcn_workitem_id_y(), __builtin_amdgcn_workitem_id_z()) threadIdx;
FT_HIP_AXIS_STRUCT(ft_hip_block_idx, __builtin_amdgcn_workgroup_id_x(),
                   __builtin_amdgcn_workgroup_id_y(), __builtin_amdgcn_workgroup_id_z()) blockIdx;
FT_HIP_AXIS_STRUCT(ft_hip_block_dim, freetoken_hip::implicit_u16()[6],
                   freetoken_hip::implicit_u16()[7], freetoken_hip::implicit_u16()[8]) blockDim;
FT_HIP_AXIS_STRUCT(ft_hip_grid_dim, freetoken_hip::implicit_u32()[0],
                   freetoken_hip::implicit_u32()[1], freetoken_hip::implicit_u32()[2]) gridDim;

#undef FT_HIP_AXIS_STRUCT

// ---------------------------------------------------------------- synchronization and shuffles

__device__ inline void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

__device__ inline unsigned int ft_hip_lane_id() {
  return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
}

// NOTE: every warp-level helper below assumes a 32-lane wavefront, as CUDA's warps: gfx11 and
// gfx12 run HIP in wave32 unless built with -mwavefrontsize64, which this check refuses (the
// kernels index lanes with threadIdx.x % 32 and keep one shared slot per 32 threads).
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN_WAVEFRONT_SIZE) && \
    __AMDGCN_WAVEFRONT_SIZE != 32
#error "the HIP shim assumes wave32 (gfx11/gfx12 default); do not build with -mwavefrontsize64"
#endif

// The mask is ignored: all lanes of the wave take part, as in every call site here.
__device__ inline int ft_hip_bpermute(int lane, int var) {
  return __builtin_amdgcn_ds_bpermute(lane << 2, var);
}

__device__ inline int __shfl_xor_sync(unsigned int, int var, int lane_mask, int width = 32) {
  int self = static_cast<int>(ft_hip_lane_id());
  int target = self ^ lane_mask;
  if (target >= ((self + width) & ~(width - 1))) target = self;
  return ft_hip_bpermute(target, var);
}

__device__ inline float __shfl_xor_sync(unsigned int mask, float var, int lane_mask,
                                        int width = 32) {
  return __builtin_bit_cast(
      float, __shfl_xor_sync(mask, __builtin_bit_cast(int, var), lane_mask, width));
}

// 64-bit values move as two 32-bit halves from the same source lane.
__device__ inline unsigned long long ft_hip_bpermute64(int lane, unsigned long long v) {
  unsigned int lo = static_cast<unsigned int>(v), hi = static_cast<unsigned int>(v >> 32);
  lo = static_cast<unsigned int>(ft_hip_bpermute(lane, static_cast<int>(lo)));
  hi = static_cast<unsigned int>(ft_hip_bpermute(lane, static_cast<int>(hi)));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Lane - delta within the 32-lane segment; lanes below delta keep their own value (as CUDA).
__device__ inline unsigned long long __shfl_up_sync(unsigned int, unsigned long long var,
                                                    unsigned int delta, int width = 32) {
  int self = static_cast<int>(ft_hip_lane_id());
  int target = self - static_cast<int>(delta);
  if (target < (self & ~(width - 1))) target = self;
  return ft_hip_bpermute64(target, var);
}

__device__ inline unsigned long long __shfl_sync(unsigned int, unsigned long long var,
                                                 int src_lane, int width = 32) {
  int self = static_cast<int>(ft_hip_lane_id());
  return ft_hip_bpermute64((self & ~(width - 1)) + (src_lane & (width - 1)), var);
}

// wave32: the ballot is exactly CUDA's 32-bit lane mask.
__device__ inline unsigned int __ballot_sync(unsigned int, int predicate) {
  return __builtin_amdgcn_ballot_w32(predicate != 0);
}

__device__ inline int __ffs(unsigned int x) { return __builtin_ffs(static_cast<int>(x)); }

__device__ inline int __popc(unsigned int x) { return __builtin_popcount(x); }

__device__ inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  return __hip_atomic_fetch_add(address, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

__device__ inline unsigned long long atomicAdd(unsigned long long* address,
                                               unsigned long long value) {
  return __hip_atomic_fetch_add(address, value, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

// ---------------------------------------------------------------- vector types

struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
__host__ __device__ inline float2 make_float2(float x, float y) { return {x, y}; }

// ---------------------------------------------------------------- math without the device libs

__device__ inline float __expf(float x) { return __builtin_expf(x); }
__device__ inline float rsqrtf(float x) { return __builtin_amdgcn_rsqf(x); }
__device__ inline float __frcp_rn(float x) { return 1.f / x; }
__device__ inline float __fdividef(float a, float b) { return a / b; }
// llvm.exp2 / maxnum / ceil / fabs / rint lower to single amdgcn instructions (no device library).
__device__ inline float exp2f(float x) { return __builtin_exp2f(x); }
__device__ inline float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
__device__ inline double ceil(double x) { return __builtin_ceil(x); }
__device__ inline float fabsf(float x) { return __builtin_fabsf(x); }
__device__ inline float rintf(float x) { return __builtin_rintf(x); }  // to nearest even
__device__ inline int min(int a, int b) { return a < b ? a : b; }
__device__ inline int max(int a, int b) { return a > b ? a : b; }

// Explicitly rounded steps: contraction off, so no FMA fuses them (as CUDA's __f*_rn).
__device__ inline float __fmul_rn(float a, float b) {
#pragma clang fp contract(off)
  return a * b;
}
__device__ inline float __fsub_rn(float a, float b) {
#pragma clang fp contract(off)
  return a - b;
}
__device__ inline unsigned int __float2uint_rz(float x) { return static_cast<unsigned int>(x); }
__device__ inline unsigned long long __float2ull_rz(float x) {
  return static_cast<unsigned long long>(x);
}
__device__ inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
__device__ inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return static_cast<unsigned long long>((static_cast<unsigned __int128>(a) * b) >> 64);
}

// ---------------------------------------------------------------- host runtime API

typedef struct ihipStream_t* hipStream_t;
typedef int hipError_t;
typedef hipStream_t cudaStream_t;
typedef hipError_t cudaError_t;
constexpr hipError_t cudaSuccess = 0;

extern "C" {
hipError_t hipGetLastError(void);
const char* hipGetErrorString(hipError_t error);
const char* hipGetErrorName(hipError_t error);
hipError_t hipGetDevice(int* device);
hipError_t hipSetDevice(int device);
// clang lowers `kernel<<<grid, block, smem, stream>>>(...)` to these three calls.
hipError_t hipLaunchKernel(const void* function, dim3 grid, dim3 block, void** args,
                           size_t shared_bytes, hipStream_t stream);
hipError_t __hipPushCallConfiguration(dim3 grid, dim3 block, size_t shared_bytes,
                                      hipStream_t stream);
hipError_t __hipPopCallConfiguration(dim3* grid, dim3* block, size_t* shared_bytes,
                                     hipStream_t* stream);
}

inline cudaError_t cudaGetLastError() { return hipGetLastError(); }
inline const char* cudaGetErrorString(cudaError_t e) { return hipGetErrorString(e); }
inline const char* cudaGetErrorName(cudaError_t e) { return hipGetErrorName(e); }
inline cudaError_t cudaGetDevice(int* device) { return hipGetDevice(device); }
inline cudaError_t cudaSetDevice(int device) { return hipSetDevice(device); }
