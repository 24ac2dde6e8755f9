// Staging GGUF weight rows through shared memory, a chunk of whole blocks at a time: a warp
// loads the chunk of each of its R rows in 16-byte words (its 32 lanes cover 512 contiguous
// bytes per load), stores the words to shared memory, and decodes blocks there at any
// alignment (Q4_0, Q5_0, Q8_0 and Q6_K blocks are only 2-byte aligned). Shared by gguf_gemv
// (quant_gemv.cu) and gguf_gemv_q8's staged kernel (gguf_gemv_q8.cu); kept free of the host
// API so the emulated tests build it too.
#pragma once

#include <cstdint>

#include "freetoken/cuda_common.cuh"
#include "freetoken/gguf_blocks.h"

namespace freetoken {
namespace gguf_stage {

using gguf::Block;

__device__ __forceinline__ void warp_sync() {
#if defined(FT_HOST_EMULATION)
  __syncwarp();
#elif defined(__HIP_PLATFORM_AMD__)
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

constexpr int gcd(int a, int b) { return b == 0 ? a : gcd(b, a % b); }

// Bytes staged per row and step: whole blocks and whole 16-byte words, about 4 KB per warp.
template <int QT, int R>
constexpr int chunk_bytes() {
  constexpr int unit = Block<QT>::kBytes * 16 / gcd(Block<QT>::kBytes, 16);
  return (4096 / R / unit > 0 ? 4096 / R / unit : 1) * unit;
}

template <int QT, int R>
struct GgufStage {
  static constexpr int kChunk = chunk_bytes<QT, R>(), kWords = kChunk / 16;
  static constexpr int kSlots = (kWords + kWarp - 1) / kWarp;  // words per lane and row
  Vec<uint32_t, 4> regs[R][kSlots];

  // Words [c0, c0 + bytes) of each row into registers (bytes a multiple of 16).
  __device__ __forceinline__ void load(const uint8_t* const (&rows)[R], int64_t c0, int bytes,
                                       int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int i = s * kWarp + lane;
        if (i < bytes / 16) regs[r][s] = load_vec<uint32_t, 4>(
            reinterpret_cast<const uint32_t*>(rows[r] + c0) + 4 * i);
      }
  }

  __device__ __forceinline__ void store(uint8_t* smem, int bytes, int lane) const {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int i = s * kWarp + lane;
        if (i < bytes / 16) {
          reinterpret_cast<Vec<uint32_t, 4>*>(smem + r * kChunk)[i] = regs[r][s];
        }
      }
  }
};

/*!
 * \brief Streams the rows through `smem` (the warp's R * kChunk bytes) a chunk of whole blocks
 * at a time and calls unit(blk, col, u) for each of this lane's 32-weight units: u of the block
 * at smem + blk * kBytes (row r's copy kChunk * r further on), its first weight at column col.
 * The first chunk's loads must already be in flight (`stage`, `bytes` of each row); every
 * next chunk's loads go out before the current chunk is used.
 */
template <int QT, int R, class Unit>
__device__ __forceinline__ void for_each_unit(GgufStage<QT, R>& stage,
                                              const uint8_t* const (&rows)[R], int64_t row_bytes,
                                              int bytes, uint8_t* smem, int lane, Unit&& unit) {
  using Stage = GgufStage<QT, R>;
  constexpr int kUnits = Block<QT>::kWeights / 32;
  for (int64_t c0 = 0; c0 < row_bytes; c0 += Stage::kChunk) {
    stage.store(smem, bytes, lane);
    warp_sync();
    const int nb = bytes / Block<QT>::kBytes;
    const int64_t next = c0 + Stage::kChunk;
    bytes = static_cast<int>(row_bytes - next < Stage::kChunk ? row_bytes - next : Stage::kChunk);
    if (next < row_bytes) stage.load(rows, next, bytes, lane);
    const int64_t col0 = c0 / Block<QT>::kBytes * Block<QT>::kWeights;
    for (int gi = lane; gi < nb * kUnits; gi += kWarp) {
      const int blk = gi / kUnits, u = gi % kUnits;
      unit(blk, col0 + static_cast<int64_t>(blk) * Block<QT>::kWeights + u * 32, u);
    }
    warp_sync();
  }
}

}  // namespace gguf_stage
}  // namespace freetoken
