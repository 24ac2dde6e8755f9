// Host stand-in for kernels/include/freetoken/cuda_common.cuh: the CUDA vocabulary the MoE GGUF
// kernels use, on CPU threads, so tests/kernel/moe_gguf_emu.cc runs the real kernel bodies
// without a GPU. One std::thread per GPU thread of a block, blocks one after another:
// __shared__ is a function-static (shared by the threads of the running block),
// __syncthreads a barrier of the block, __syncwarp, warp_sum and __ballot_sync barriers of the
// warp.
// Misaligned vector accesses abort, as they would fault on the GPU. The HIP paths are taken (no wmma here).
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#define FT_HOST_EMULATION 1
#define __HIP_PLATFORM_AMD__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __expf expf

namespace freetoken {

constexpr int kWarp = 32;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct bf16 {
  uint16_t bits;
};

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline bf16 from_float<bf16>(float v) {  // round to nearest even, as __float2bfloat16_rn
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{0x7FC0};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bf16{static_cast<uint16_t>(u >> 16)};
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

inline void check_aligned(const void* p, size_t n) {
  if (reinterpret_cast<uintptr_t>(p) % n != 0) {
    std::fprintf(stderr, "misaligned %zu-byte vector access at %p\n", n, p);
    std::abort();
  }
}

template <typename T, int N>
inline Vec<T, N> load_vec(const T* p) {
  check_aligned(p, sizeof(Vec<T, N>));
  Vec<T, N> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename T, int N>
inline void store_vec(T* p, const Vec<T, N>& v) {
  check_aligned(p, sizeof(Vec<T, N>));
  std::memcpy(p, &v, sizeof(v));
}

namespace emu {

struct Idx {
  unsigned x = 0, y = 0, z = 0;
};

struct BlockState {
  std::barrier<>* all;
  std::vector<std::unique_ptr<std::barrier<>>>* warps;
  float* lanes;  // one slot per thread for warp_sum
};

inline thread_local Idx thread_idx, block_idx, block_dim, grid_dim;
inline thread_local BlockState* block = nullptr;

}  // namespace emu

#define threadIdx (::freetoken::emu::thread_idx)
#define blockIdx (::freetoken::emu::block_idx)
#define blockDim (::freetoken::emu::block_dim)
#define gridDim (::freetoken::emu::grid_dim)

inline void __syncthreads() { emu::block->all->arrive_and_wait(); }

inline void __syncwarp() {
  (*emu::block->warps)[static_cast<int>(threadIdx.x) / kWarp]->arrive_and_wait();
}

inline float warp_sum(float v) {
  const int t = static_cast<int>(threadIdx.x), w = t / kWarp;
  emu::block->lanes[t] = v;
  (*emu::block->warps)[w]->arrive_and_wait();
  const int first = w * kWarp, last = std::min<int>(first + kWarp, blockDim.x);
  float s = 0.f;
  for (int i = first; i < last; ++i) s += emu::block->lanes[i];
  (*emu::block->warps)[w]->arrive_and_wait();
  return s;
}

// A warp's lane mask of `predicate` (lanes past a short last warp read as 0).
inline unsigned __ballot_sync(unsigned, int predicate) {
  const int t = static_cast<int>(threadIdx.x), w = t / kWarp;
  emu::block->lanes[t] = predicate ? 1.f : 0.f;
  (*emu::block->warps)[w]->arrive_and_wait();
  const int first = w * kWarp, last = std::min<int>(first + kWarp, blockDim.x);
  unsigned mask = 0;
  for (int i = first; i < last; ++i) {
    if (emu::block->lanes[i] != 0.f) mask |= 1u << (i - first);
  }
  (*emu::block->warps)[w]->arrive_and_wait();
  return mask;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }

}  // namespace freetoken
