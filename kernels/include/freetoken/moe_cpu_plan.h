// The work plan of the CPU moe_experts kernel: the (token, k) pairs grouped by expert slot, and
// the activation buffers in that order, carved from one block the calling thread keeps.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "freetoken/moe_cpu_args.h"
#include "freetoken/quant_dispatch.h"
#include "freetoken/quant_packed.h"

namespace freetoken {
namespace moe {

using quant::Isa;
using quant::QuantizedRows;

/*! \brief Activation rows in sorted pair order: f32 rows, or int8 blocks for GGUF weights. */
struct Acts {
  float* f = nullptr;  // [pairs, width]
  QuantizedRows q;     // [pairs, width / 32 blocks]
  int32_t* sum16 = nullptr;  // [pairs, 2 * blocks] for packed Q6_K weights (q.sum16 reads it)

  QuantizedRows rows(int64_t first, int64_t count) const {
    QuantizedRows v = q;
    v.rows = count;
    v.q += first * q.blocks * quant::kBlock;
    v.d += first * q.blocks;
    v.s += first * q.blocks;
    if (sum16 != nullptr) v.sum16 = sum16 + first * 2 * q.blocks;
    return v;
  }
};

/*! \brief What the steps of one call share: the inputs, the grouping and the buffers. */
struct Plan {
  Shape sh;
  Format f13, f2;
  Isa isa = Isa::kScalar;
  const float* x = nullptr;
  float* out = nullptr;
  const uint8_t *w13 = nullptr, *w2 = nullptr;
  int64_t rb13 = 0, rb2 = 0;      // bytes of one weight row
  int64_t pairs = 0, n_active = 0, max_rows = 0;
  int64_t* offset = nullptr;      // [S + 1]: the slot's pairs are [offset[s], offset[s + 1])
  int32_t* active = nullptr;      // [n_active] slots with pairs, ascending
  int32_t* token = nullptr;       // [pairs] token of each sorted pair
  float* weight = nullptr;        // [pairs] its routing weight
  Acts xs, act;                   // x rows [pairs, H]; silu(gate) * up [pairs, I]
};

// Carves the plan's buffers from one block; with base 0 it only measures.
struct Carver {
  uintptr_t base;
  size_t used = 0;
  template <typename T>
  T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(base + used);
    used += (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
    return p;
  }
};

inline void carve_blocks(Carver& c, Acts& a, int64_t pairs, int64_t width, const Format& f) {
  a.q.rows = pairs;
  a.q.blocks = width / quant::kBlock;
  a.q.q = c.take<int8_t>(pairs * width);
  a.q.d = c.take<float>(pairs * a.q.blocks);
  a.q.s = c.take<float>(pairs * a.q.blocks);
  a.sum16 = f.packed && quant::needs_sum16(f.type) ? c.take<int32_t>(pairs * 2 * a.q.blocks)
                                                   : nullptr;
  a.q.sum16 = a.sum16;
}

inline size_t carve(Plan& p, uintptr_t base) {
  Carver c{base};
  p.offset = c.take<int64_t>(p.sh.s + 1);
  p.active = c.take<int32_t>(p.sh.s);
  p.token = c.take<int32_t>(p.pairs);
  p.weight = c.take<float>(p.pairs);
  if (p.f13.quantized) {
    carve_blocks(c, p.xs, p.pairs, p.sh.h, p.f13);
  } else {
    p.xs.f = c.take<float>(p.pairs * p.sh.h);
  }
  p.act.f = c.take<float>(p.pairs * p.sh.i);
  if (p.f2.quantized) carve_blocks(c, p.act, p.pairs, p.sh.i, p.f2);
  return c.used;
}

// The calling thread's buffers, grown on demand and reused across calls (no per-call allocation).
inline void allocate(Plan& p) {
  thread_local std::vector<uint8_t> storage;
  const size_t need = carve(p, 0) + 64;
  if (storage.size() < need) storage.resize(need);
  carve(p, (reinterpret_cast<uintptr_t>(storage.data()) + 63) / 64 * 64);
}

/*! \brief Groups the (token, k) pairs by expert slot: a counting sort, stable in token order. */
inline void sort_pairs(Plan& p, const int32_t* ids, const float* weights, const int32_t* map) {
  int64_t* off = p.offset;
  std::fill(off, off + p.sh.s + 1, 0);
  for (int64_t q = 0; q < p.pairs; ++q) ++off[map[ids[q]] + 1];
  for (int64_t s = 0; s < p.sh.s; ++s) {
    if (off[s + 1] > 0) p.active[p.n_active++] = static_cast<int32_t>(s);
    p.max_rows = std::max(p.max_rows, off[s + 1]);
    off[s + 1] += off[s];
  }
  for (int64_t q = 0; q < p.pairs; ++q) {  // off[s] walks to the slot's end
    const int64_t at = off[map[ids[q]]]++;
    p.token[at] = static_cast<int32_t>(q / p.sh.k);
    p.weight[at] = weights[q];
  }
  std::memmove(off + 1, off, p.sh.s * sizeof(int64_t));
  off[0] = 0;
}

}  // namespace moe
}  // namespace freetoken
