// The routing-independent half of the GPU MoE experts kernels (kernels/cuda/moe.cu over float
// weights, kernels/cuda/moe_gguf.cu over GGUF blocks): the workspace plan and the alignment
// pass that groups the (token, k) pairs by expert into tiles. Both kernels share it so one
// workspace size (ops.moe_workspace_bytes) and one tile table serve either weight format.
#pragma once

#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace moe_align {

constexpr int kMaxTopK = 16;
constexpr int kMaxExperts = 1024;  // one align thread per expert
constexpr int kAlignThreads = 1024;
constexpr int kGemvRows = 8;       // pairs per decode tile (registers per lane)
constexpr int kGemvMaxPairs = 256;
constexpr int kTileRows = 64;      // pairs per prefill tile (moe_tile::kTM)

// ---------------------------------------------------------------- workspace plan
// Mirrors ops.moe_workspace_bytes exactly: keep the two in step.

struct Plan {
  int64_t pairs = 0, max_tiles = 0, y_cols = 0;
  int tile_m = kGemvRows;
  bool gemv = true;
  int64_t off_tiles = 0, off_sorted = 0, off_act = 0, off_y = 0, total = 0;
};

inline int64_t align256(int64_t v) { return (v + 255) / 256 * 256; }

inline Plan make_plan(int64_t tokens, int64_t top_k, int64_t experts, int64_t inter,
                      int64_t itemsize) {
  Plan p;
  p.pairs = tokens * top_k;
  int64_t gemv_limit = experts * 4 < kGemvMaxPairs ? experts * 4 : kGemvMaxPairs;
  p.gemv = p.pairs <= gemv_limit;
  p.tile_m = p.gemv ? kGemvRows : kTileRows;
  p.max_tiles = ceil_div(p.pairs, p.tile_m) + (experts < p.pairs ? experts : p.pairs);
  int64_t cols = ceil_div(inter, 64) * 64;
  p.y_cols = cols > 512 ? cols : 512;
  p.off_tiles = 0;
  p.off_sorted = align256(3 * 4 * p.max_tiles);
  p.off_act = p.off_sorted + align256(4 * p.pairs);
  p.off_y = p.off_act + align256(itemsize * p.pairs * inter);
  p.total = p.off_y + (p.gemv ? 0 : align256(4 * p.pairs * p.y_cols));
  return p;
}

// ---------------------------------------------------------------- small device helpers

__device__ __forceinline__ int shared_atomic_add(int* p, int v) {
#if defined(__HIP_PLATFORM_AMD__)
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#else
  return atomicAdd(p, v);
#endif
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

// The slot of expert id `e`, or -1 when the id or its map entry is out of range (such a pair
// contributes nothing: a device-side check cannot raise without a sync).
__device__ __forceinline__ int slot_of(int e, const int* expert_map, int experts, int slots) {
  if (e < 0 || e >= experts) return -1;
  int s = expert_map[e];
  return s >= 0 && s < slots ? s : -1;
}

// ---------------------------------------------------------------- alignment

struct TileTable {
  int* expert;  // [max_tiles] expert id of the tile, -1 past the last tile
  int* start;   // [max_tiles] first position in `sorted`
  int* rows;    // [max_tiles] pairs in the tile (1..tile_m)
};

// One block of n >= E threads (a multiple of 32, at most kAlignThreads; n grows with the pairs
// so a prefill batch is read in few passes): thread e owns expert e through the scan.
__global__ void __launch_bounds__(kAlignThreads)
align_kernel(TileTable tt, int* __restrict__ sorted, const int* __restrict__ topk_ids,
             const int* __restrict__ expert_map, int pairs, int experts, int slots, int tile_m,
             int max_tiles) {
  __shared__ int s_count[kAlignThreads];
  __shared__ int s_pairs[kAlignThreads];
  __shared__ int s_tiles[kAlignThreads];
  int tid = threadIdx.x, n = blockDim.x;
  s_count[tid] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += n) {
    int e = topk_ids[p];
    if (slot_of(e, expert_map, experts, slots) >= 0) shared_atomic_add(&s_count[e], 1);
  }
  __syncthreads();
  int count = s_count[tid];
  int ntiles = (count + tile_m - 1) / tile_m;
  s_pairs[tid] = count;
  s_tiles[tid] = ntiles;
  __syncthreads();
  for (int off = 1; off < n; off <<= 1) {  // inclusive Hillis-Steele scan
    int a = tid >= off ? s_pairs[tid - off] : 0;
    int b = tid >= off ? s_tiles[tid - off] : 0;
    __syncthreads();
    s_pairs[tid] += a;
    s_tiles[tid] += b;
    __syncthreads();
  }
  int pair_base = s_pairs[tid] - count, tile_base = s_tiles[tid] - ntiles;
  int total_tiles = s_tiles[n - 1];
  for (int j = 0; j < ntiles; ++j) {
    tt.expert[tile_base + j] = tid;
    tt.start[tile_base + j] = pair_base + j * tile_m;
    int left = count - j * tile_m;
    tt.rows[tile_base + j] = left < tile_m ? left : tile_m;
  }
  for (int i = total_tiles + tid; i < max_tiles; i += n) tt.expert[i] = -1;
  s_count[tid] = pair_base;  // now the scatter cursor
  __syncthreads();
  for (int p = tid; p < pairs; p += n) {
    int e = topk_ids[p];
    if (slot_of(e, expert_map, experts, slots) >= 0) sorted[shared_atomic_add(&s_count[e], 1)] = p;
  }
}

#if !defined(FT_HOST_EMULATION)  // a host build (tests/kernel/moe_gguf_emu.cc) launches itself
/*! \brief The tile table and the pair ids sorted by expert, per `plan`, on `stream`. */
inline void launch_align(const TileTable& tt, int* sorted, const int* topk_ids,
                         const int* expert_map, const Plan& plan, int experts, int slots,
                         cudaStream_t stream) {
  int64_t want = plan.pairs > experts ? plan.pairs : experts;
  int threads = static_cast<int>(want < kAlignThreads ? ceil_div(want, kWarp) * kWarp
                                                      : kAlignThreads);
  align_kernel<<<1, threads, 0, stream>>>(tt, sorted, topk_ids, expert_map,
                                          static_cast<int>(plan.pairs), experts, slots,
                                          plan.tile_m, static_cast<int>(plan.max_tiles));
  check_launch("moe align");
}
#endif

/*! \brief The tile table, sorted pair ids, activations and f32 chunk inside the workspace. */
template <typename Act>
inline void carve(char* ws, const Plan& plan, TileTable* tt, int** sorted, Act** act,
                  float** y) {
  int* tiles = reinterpret_cast<int*>(ws + plan.off_tiles);
  *tt = TileTable{tiles, tiles + plan.max_tiles, tiles + 2 * plan.max_tiles};
  *sorted = reinterpret_cast<int*>(ws + plan.off_sorted);
  *act = reinterpret_cast<Act*>(ws + plan.off_act);
  *y = reinterpret_cast<float*>(ws + plan.off_y);
}

}  // namespace moe_align
}  // namespace freetoken
