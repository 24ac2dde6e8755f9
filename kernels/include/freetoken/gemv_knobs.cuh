// The performance knobs of the decode GEMV (kernels/cuda/decode_gemv.cu), one row of kVariants
// per compiled variant, chosen at run time by its index: benchmarks/gemv_sweep.py times them
// all without a rebuild, and forward/fused_decode.py's GEMV_VARIANTS mirrors this table (keep
// the two in step). Variant 0 is the original kernel and the default.
#pragma once

#include "freetoken/cuda_common.cuh"

namespace freetoken {

// How a weight vector is loaded. The weights are streamed once per step: there is nothing to
// gain from keeping them in L1, and the non-coherent path (ld.global.nc) may be issued earlier.
enum WeightLoad : int {
  kLoadPlain = 0,     // an ordinary 16-byte load
  kLoadNoL1 = 1,      // ld.global.nc.L1::no_allocate
  kLoadNoL1L2Pf = 2,  // the same, asking L2 to fetch the whole 256-byte sector group
};

struct GemvKnobs {
  int threads;  // per block; a block holds threads / group output rows
  int unroll;   // 16-byte weight loads per thread and row issued before any is used
  int load;     // WeightLoad
  bool pipe;    // issue the next batch of loads before the current batch's math (and the
                // first batch before the RMSNorm prologue's reduction)
  bool pdl;     // programmatic dependent launch (sm_90+, pipelined variants only): the blocks
                // start, and load their first weights, while the previous kernel drains
};

// Rows that differ only in `pdl` share their compiled kernels (it is a launch attribute).
constexpr GemvKnobs kGemvVariants[] = {
    {256, 4, kLoadPlain, false, false},    // 0: the original kernel
    {256, 4, kLoadNoL1, false, false},     // 1: cache hint alone
    {256, 4, kLoadNoL1, true, false},      // 2: + software pipelining
    {256, 8, kLoadNoL1, true, false},      // 3: twice the bytes in flight
    {128, 4, kLoadNoL1, true, false},      // 4: smaller blocks (a shorter last wave)
    {256, 8, kLoadNoL1L2Pf, true, false},  // 5: 256-byte L2 prefetch
    {256, 4, kLoadNoL1, true, true},       // 6: 2 launched early
    {256, 8, kLoadNoL1, true, true},       // 7: 3 launched early
    {128, 4, kLoadNoL1, true, true},       // 8: 4 launched early
};
constexpr int kNumGemvVariants = sizeof(kGemvVariants) / sizeof(kGemvVariants[0]);

template <int THREADS, int UNROLL, int LOAD, bool PIPE>
struct Knobs {
  static constexpr int kThreads = THREADS;
  static constexpr int kWarps = THREADS / kWarp;
  static constexpr int kUnroll = UNROLL;
  static constexpr int kLoad = LOAD;
  static constexpr bool kPipe = PIPE;
};

/*! \brief Wait until the kernels this one depends on have finished and their writes are
 * visible: a no-op unless launched as a programmatic dependent (and before sm_90, or on HIP). */
__device__ __forceinline__ void wait_for_inputs() {
#if !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/*! \brief Let the next kernel, if launched as a programmatic dependent, start its blocks. */
__device__ __forceinline__ void allow_dependents() {
#if !defined(__HIP_PLATFORM_AMD__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/*! \brief One 16-byte weight vector, loaded as knob LOAD says (HIP: always a plain load). */
template <int LOAD, typename T, int V>
__device__ __forceinline__ Vec<T, V> load_weight(const T* p) {
#if defined(__HIP_PLATFORM_AMD__)
  return load_vec<T, V>(p);
#else
  static_assert(sizeof(Vec<T, V>) == 16, "weight vectors are 16 bytes");
  if constexpr (LOAD == kLoadPlain) {
    return load_vec<T, V>(p);
  } else {
    uint32_t r0, r1, r2, r3;
    if constexpr (LOAD == kLoadNoL1) {
      asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
          : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
          : "l"(p));
    } else {
      asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
          : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
          : "l"(p));
    }
    Vec<T, V> v;
    uint32_t* u = reinterpret_cast<uint32_t*>(&v);
    u[0] = r0, u[1] = r1, u[2] = r2, u[3] = r3;
    return v;
  }
#endif
}

}  // namespace freetoken
