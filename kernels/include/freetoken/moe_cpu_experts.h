// The CPU routed-experts engine behind moe_experts (f32 weights) and moe_experts_quant (GGUF
// rows) in kernels/cpu/moe.cc, and moe_experts_scaled (FP8 codes with their scales) in
// kernels/cpu/moe_scaled.cc.
//
// Only routed experts run. The (token, k) pairs are grouped by expert slot (a counting sort;
// a slot's pairs stay in token order), then in four steps:
//   1. every pair's x row is copied (float or FP8 w13) or quantized to int8 blocks (GGUF w13)
//      into that order, so one expert's rows are contiguous;
//   2. tasks of (expert, 32 rows of I) compute gate and up for all of the expert's rows at once
//      and write act = silu(gate) * up: each weight row is read once per call;
//   3. act rows are quantized when w2 holds GGUF blocks;
//   4. tasks of 32 columns of H own those columns of out: they zero them, then add
//      weight * (w2 @ act) for every routed expert in slot order. No two tasks write one
//      element and every sum runs in a fixed order, so no result depends on the thread count.
// Decode (T = 1, top-8) gives 8 * I / 32 tasks in step 2 and H / 32 in step 4: both cores busy.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/float_rows.h"
#include "freetoken/moe_cpu_args.h"
#include "freetoken/moe_cpu_plan.h"
#include "freetoken/quant_dispatch.h"
#include "freetoken/quant_packed.h"

namespace freetoken {
namespace moe {

constexpr int64_t kGateRows = 32;  // rows of I per gate/up task: one int8 block of act
constexpr int64_t kDownCols = 32;  // columns of H per down task
constexpr int64_t kInlineRows = 16;  // fewer rows than this are prepared on the calling thread

// A worker's scratch for one task's gate/up or down outputs.
inline float* task_scratch(int64_t floats) {
  thread_local std::vector<float> storage;
  if (storage.size() < static_cast<size_t>(floats)) storage.resize(floats);
  return storage.data();
}

// out[r * width + j] = activation row r . weight row j of `w`, for `rows` rows and j < width;
// `w` is row `row0` of expert slot `slot` (where FP8 weights find their scales).
inline void product(const Plan& p, const Format& f, const uint8_t* w, int64_t rb, int64_t width,
                    int64_t k, const Acts& a, int64_t first, int64_t rows, float* out,
                    int64_t slot, int64_t row0) {
  if (f.packed) {  // tasks start on whole tiles: I and H are multiples of 16 (check_packed)
    quant::packed::matmul_tiles(w, rb, f.type, 0, width / quant::kPackRows, a.rows(first, rows),
                                out, width);
  } else if (f.quantized) {
    quant::matmul_rows(p.isa, w, rb, f.type, 0, width, a.rows(first, rows), out, width);
  } else if (f.type == floatrows::kE4M3) {
    const floatrows::BlockScales s = f.fp8.scales(slot, row0);
    floatrows::float_rows(p.isa != Isa::kScalar, w, rb, f.type, 0, width, a.f + first * k, k,
                          rows, k, out, width, &s);
  } else {
    floatrows::float_rows(p.isa != Isa::kScalar, w, rb, f.type, 0, width, a.f + first * k, k,
                          rows, k, out, width);
  }
}

// Steps 1 and 3: rows [q0, q1) of x (by each pair's token) or of act into dst's form: a copy
// (float weights; act is already in place) or int8 blocks (GGUF weights).
inline void prepare_rows(const Plan& p, const Format& f, const Acts& dst, int64_t width, bool from_x,
                  int64_t q0, int64_t q1) {
  for (int64_t q = q0; q < q1; ++q) {
    const float* row = from_x ? p.x + p.token[q] * width : dst.f + q * width;
    if (f.quantized) {
      quant::quantize(p.isa, f.type, row, width, 0, 1, dst.rows(q, 1));
      if (dst.sum16 != nullptr) quant::fill_sum16(dst.q, q, q + 1, dst.sum16);
    } else if (from_x) {
      std::memcpy(dst.f + q * width, row, width * sizeof(float));
    }
  }
}

#define FT_ALWAYS_INLINE inline __attribute__((always_inline))

FT_ALWAYS_INLINE void silu_mul_rows(float* out, int64_t ldo, const float* gate, const float* up,
                                    int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; j += 8) {
      float g[8] = {}, u[8] = {}, y[8];
      const int64_t n = std::min<int64_t>(8, width - j);
      std::memcpy(g, gate + r * width + j, n * sizeof(float));
      std::memcpy(u, up + r * width + j, n * sizeof(float));
      const v8f gv = load8(g);
      store8(y, gv / (1.0f + exp8(-gv)) * load8(u));
      std::memcpy(out + r * ldo + j, y, n * sizeof(float));
    }
  }
}

__attribute__((target("avx2,fma"))) inline void silu_mul_avx2(float* out, int64_t ldo, const float* g,
                                                       const float* u, int64_t rows, int64_t w) {
  silu_mul_rows(out, ldo, g, u, rows, w);
}
inline void silu_mul_baseline(float* out, int64_t ldo, const float* g, const float* u, int64_t rows,
                       int64_t w) {
  silu_mul_rows(out, ldo, g, u, rows, w);
}

// Step 2: gate and up rows [i0, i0 + 32) of one routed expert for all of its pairs.
inline void gate_up_task(const Plan& p, int64_t task) {
  const int64_t chunks = (p.sh.i + kGateRows - 1) / kGateRows;
  const int32_t slot = p.active[task / chunks];
  const int64_t i0 = task % chunks * kGateRows, width = std::min(kGateRows, p.sh.i - i0);
  const int64_t first = p.offset[slot], rows = p.offset[slot + 1] - first;
  float* gate = task_scratch(2 * rows * width);
  float* up = gate + rows * width;
  const uint8_t* w = p.w13 + slot * 2 * p.sh.i * p.rb13;
  product(p, p.f13, w + i0 * p.rb13, p.rb13, width, p.sh.h, p.xs, first, rows, gate, slot, i0);
  product(p, p.f13, w + (p.sh.i + i0) * p.rb13, p.rb13, width, p.sh.h, p.xs, first, rows, up,
          slot, p.sh.i + i0);
  float* dst = p.act.f + first * p.sh.i + i0;
  if (p.isa == Isa::kScalar) {
    silu_mul_baseline(dst, p.sh.i, gate, up, rows, width);
  } else {
    silu_mul_avx2(dst, p.sh.i, gate, up, rows, width);
  }
}

// Step 4: columns [n0, n0 + 32) of out, summed over every routed expert.
inline void down_task(const Plan& p, int64_t task) {
  const int64_t h = p.sh.h, n0 = task * kDownCols, width = std::min(kDownCols, h - n0);
  for (int64_t t = 0; t < p.sh.t; ++t) std::fill_n(p.out + t * h + n0, width, 0.f);
  float* y = task_scratch(p.max_rows * width);
  for (int64_t a = 0; a < p.n_active; ++a) {
    const int32_t slot = p.active[a];
    const int64_t first = p.offset[slot], rows = p.offset[slot + 1] - first;
    const uint8_t* w = p.w2 + (slot * h + n0) * p.rb2;
    product(p, p.f2, w, p.rb2, width, p.sh.i, p.act, first, rows, y, slot, n0);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = p.out + p.token[first + r] * h + n0;
      const float wt = p.weight[first + r];
      for (int64_t j = 0; j < width; ++j) o[j] += wt * y[r * width + j];
    }
  }
}

inline void prepare(const Plan& p, const Format& f, const Acts& dst, int64_t width, bool from_x) {
  if (!f.quantized && !from_x) return;
  if (p.pairs < kInlineRows) {
    prepare_rows(p, f, dst, width, from_x, 0, p.pairs);
  } else {
    parallel_for(p.pairs, 8, [&](int64_t q0, int64_t q1) {
      prepare_rows(p, f, dst, width, from_x, q0, q1);
    });
  }
}

inline void run_experts(Isa isa, TensorView out, TensorView x, TensorView w13, TensorView w2,
                 Format f13, Format f2, bool bytes, TensorView topk_ids, TensorView topk_weights,
                 TensorView expert_map, TensorView workspace) {
  Plan p;
  p.sh = check_experts(out, x, w13, w2, f13, f2, bytes, topk_ids, topk_weights, expert_map,
                       workspace);
  p.f13 = f13, p.f2 = f2, p.isa = isa;
  p.pairs = p.sh.t * p.sh.k;
  p.out = data_of<float>(out);
  if (p.sh.t == 0 || p.sh.h == 0) return;
  if (p.pairs == 0 || p.sh.i == 0) {
    std::fill_n(p.out, p.sh.t * p.sh.h, 0.f);
    return;
  }
  p.x = data_of<float>(x);
  p.w13 = static_cast<const uint8_t*>(w13.data_ptr()) + w13.byte_offset();
  p.w2 = static_cast<const uint8_t*>(w2.data_ptr()) + w2.byte_offset();
  p.rb13 = f13.pitch(w13, p.sh.h);
  p.rb2 = f2.pitch(w2, p.sh.i);
  allocate(p);
  sort_pairs(p, data_of<int32_t>(topk_ids), data_of<float>(topk_weights),
             data_of<int32_t>(expert_map));
  prepare(p, f13, p.xs, p.sh.h, true);
  const int64_t chunks = (p.sh.i + kGateRows - 1) / kGateRows;
  parallel_for(p.n_active * chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) gate_up_task(p, task);
  });
  prepare(p, f2, p.act, p.sh.i, false);
  parallel_for((p.sh.h + kDownCols - 1) / kDownCols, 1, [&](int64_t a, int64_t b) {
    for (int64_t task = a; task < b; ++task) down_task(p, task);
  });
}

#undef FT_ALWAYS_INLINE

}  // namespace moe
}  // namespace freetoken
