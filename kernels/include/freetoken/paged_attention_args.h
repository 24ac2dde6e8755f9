// Arguments of paged_attention on the CPU: the problem description the kernel works from, and
// the checks that build it. Every input is validated here, on the calling thread, because the
// pool's workers must not throw.
#pragma once

#include <utility>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace attention {

using ConvertRow = void (*)(float* dst, const void* src, int64_t n);

struct Problem {
  int64_t tokens, q_heads, kv_heads, head_dim, group, batch, max_blocks, block_size, window;
  int64_t q_token_stride, out_token_stride;
  float scale;
  const void* q;
  void* out;
  const void* k;
  const void* v;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  FloatType q_type, out_type, cache_type;  // cache_type unused for an FP8 pool
  ConvertRow convert;  // cache rows to f32 (unused for f32 caches and FP8 pools)
  const float* k_scale = nullptr;  // FP8 pool: one scale per (slot, KV head); null otherwise
  const float* v_scale = nullptr;
  float* partials;     // split tasks write their rows' [m, l, acc[D]] here
};

/*! \brief Checks dtypes, ranks and shapes; fills the head counts and dims. An FP8 pool
 * (`fp8`) is uint8 e4m3 codes; its scales are checked by check_fp8_scales. */
inline Problem check_problem(const TensorView& out, const TensorView& q,
                             const TensorView& k_cache, const TensorView& v_cache,
                             int64_t block_size, int64_t sliding_window, bool fp8 = false) {
  Problem p{};
  p.q_type = float_type(q, "q");
  p.out_type = float_type(out, "out");
  if (fp8) {
    check_dtype(k_cache, kDLUInt, 8, "k_cache", "uint8 (e4m3 codes)");
    p.cache_type = FloatType::kF32;
  } else {
    p.cache_type = float_type(k_cache, "k_cache");
  }
  check_same_dtype(v_cache, k_cache, "v_cache", "k_cache");
  check_ndim(q, 3, "q");
  check_ndim(out, 3, "out");
  check_ndim(k_cache, 3, "k_cache");
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  for (int i = 0; i < 3; ++i) {
    TVM_FFI_ICHECK(out.size(i) == q.size(i)) << "out must have q's shape [T, Hq, D]";
    TVM_FFI_ICHECK(v_cache.ndim() == 3 && v_cache.size(i) == k_cache.size(i))
        << "v_cache must have k_cache's shape [S, Hk, D]";
  }
  p.tokens = q.size(0);
  p.q_heads = q.size(1);
  p.head_dim = q.size(2);
  p.kv_heads = k_cache.size(1);
  TVM_FFI_ICHECK(k_cache.size(2) == p.head_dim)
      << "k_cache head dim " << k_cache.size(2) << " differs from q's " << p.head_dim;
  TVM_FFI_ICHECK(p.kv_heads > 0 && p.q_heads % p.kv_heads == 0)
      << "q heads (" << p.q_heads << ") must be a multiple of KV heads (" << p.kv_heads << ")";
  TVM_FFI_ICHECK(block_size > 0 && k_cache.size(0) % block_size == 0)
      << "block_size " << block_size << " must be positive and divide the pool's "
      << k_cache.size(0) << " slots";
  TVM_FFI_ICHECK(sliding_window >= 0) << "sliding_window must be >= 0, got " << sliding_window;
  return p;
}

/*! \brief An FP8 pool's scales: float32 [S, Hk], one per (slot, KV head) of k_cache. */
inline void check_fp8_scales(Problem& p, const TensorView& k_cache, const TensorView& k_scale,
                             const TensorView& v_scale) {
  for (auto [t, name] : {std::pair{&k_scale, "k_scale"}, {&v_scale, "v_scale"}}) {
    check_dtype(*t, kDLFloat, 32, name, "float32");
    check_contiguous(*t, name);
    TVM_FFI_ICHECK(t->ndim() == 2 && t->size(0) == k_cache.size(0) &&
                   t->size(1) == k_cache.size(1))
        << name << " must be [S, Hk] = [" << k_cache.size(0) << ", " << k_cache.size(1) << "]";
  }
  p.k_scale = data_of<float>(k_scale);
  p.v_scale = data_of<float>(v_scale);
}

// Lengths, strides and data pointers of a checked problem.
inline void fill_problem(Problem& p, const TensorView& out, const TensorView& q,
                         const TensorView& k_cache, const TensorView& v_cache,
                         const TensorView& block_tables, const TensorView& seq_lens,
                         const TensorView& query_start_loc, int64_t block_size, double scale,
                         int64_t sliding_window) {
  p.q_token_stride = row_view(q, 2, "q").uniform_stride();  // one leading dim: always uniform
  p.out_token_stride = row_view(out, 2, "out").uniform_stride();
  p.group = p.q_heads / p.kv_heads;
  p.block_size = block_size;
  p.window = sliding_window;
  p.scale = static_cast<float>(scale);
  p.q = data_of<void>(q);
  p.out = data_of<void>(out);
  p.k = data_of<void>(k_cache);
  p.v = data_of<void>(v_cache);
  for (auto [t, name] : {std::pair{&block_tables, "block_tables"}, {&seq_lens, "seq_lens"},
                         {&query_start_loc, "query_start_loc"}}) {
    check_contiguous(*t, name);
    check_dtype(*t, kDLInt, 32, name, "int32");
  }
  check_ndim(block_tables, 2, "block_tables");
  p.batch = block_tables.size(0);
  p.max_blocks = block_tables.size(1);
  TVM_FFI_ICHECK(seq_lens.ndim() == 1 && seq_lens.size(0) == p.batch)
      << "seq_lens must be [" << p.batch << "] (one per block_tables row)";
  TVM_FFI_ICHECK(query_start_loc.ndim() == 1 && query_start_loc.size(0) == p.batch + 1)
      << "query_start_loc must be [" << p.batch + 1 << "] (batch + 1)";
  p.block_tables = data_of<int32_t>(block_tables);
  p.seq_lens = data_of<int32_t>(seq_lens);
  p.query_start = data_of<int32_t>(query_start_loc);
}

// Checks every sequence's lengths and the block ids it will read (workers must not throw).
inline void check_sequences(const Problem& p) {
  TVM_FFI_ICHECK(p.query_start[0] >= 0 && p.query_start[p.batch] <= p.tokens)
      << "query_start_loc must lie within q's " << p.tokens << " tokens";
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.query_start[b + 1] - p.query_start[b], seq_len = p.seq_lens[b];
    TVM_FFI_ICHECK(q_len >= 0) << "query_start_loc must be non-decreasing (sequence " << b << ")";
    if (q_len == 0) continue;
    TVM_FFI_ICHECK(seq_len >= q_len)
        << "seq_lens[" << b << "] = " << seq_len << " is less than its " << q_len << " new tokens";
    const int64_t pages = (seq_len + p.block_size - 1) / p.block_size;
    TVM_FFI_ICHECK(pages <= p.max_blocks)
        << "sequence " << b << " needs " << pages << " blocks but block_tables has "
        << p.max_blocks << " columns";
  }
}

inline void check_block_ids(const Problem& p, int64_t num_blocks) {
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.query_start[b + 1] == p.query_start[b]) continue;
    const int64_t pages = (p.seq_lens[b] + p.block_size - 1) / p.block_size;
    for (int64_t i = 0; i < pages; ++i) {
      const int64_t id = p.block_tables[b * p.max_blocks + i];
      TVM_FFI_ICHECK(id >= 0 && id < num_blocks)
          << "block_tables[" << b << ", " << i << "] = " << id << " is outside the pool's "
          << num_blocks << " blocks";
    }
  }
}

}  // namespace attention
}  // namespace freetoken
