// Causal attention of new tokens over the paged KV pool on the CPU: prefill chunks and decode
// steps of many sequences in one call, GQA, optional sliding window, f32/bf16/f16 caches and
// the FP8 pool (e4m3 codes, one scale per slot and KV head: freetoken/fp8_encode.h).
//
// A task is (sequence, tile of query tokens, KV head, range of keys): its rows are the tile's
// tokens times the query heads of that KV head, so each K/V row is read (or converted from
// bf16/f16) once for all of them. Keys are walked in chunks with an online softmax in f32.
// When there are few tasks (small-batch decode) the key range is split and the partial results
// are merged afterwards, so every core gets work. The task body is compiled for AVX2+FMA and
// for baseline x86-64, with the head dim fixed at 64 or 128 (registers) or left dynamic.
//
// A query row's result does not depend on the other rows of the call (batch invariance): keys
// are walked in chunks and blocks at fixed absolute positions, each block of kSplitKeys keys
// gets its own online softmax, and blocks are folded left to right by one function, fold_row,
// whether one task walks them all or each block was a split task of its own. So a token's
// output is the same bits in a decode step, a prefill chunk or a speculative verify step.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/paged_attention_args.h"

namespace freetoken {
namespace {

using attention::ConvertRow;
using attention::Problem;

// Keys per softmax step: every query row of a task re-reads the chunk's K and V rows, and 32
// keys of f32 head dim 64 (16 KB) stay in a 32 KB L1 where 64 keys did not (measured ~15% faster).
constexpr int64_t kChunk = 32;
constexpr int64_t kTileRows = 32;       // query rows (tokens x heads) per task
constexpr int64_t kSplitKeys = 256;     // keys per block: the unit of splitting and folding
// Below this many (query row, key) pairs in all (~4 ns each) a call runs on the calling thread:
// handing a few microseconds of work to the pool costs more than it saves.
constexpr int64_t kMinPoolWork = 384;

// Query tokens [t0, t1) (indices among the sequence's new tokens) of sequence `seq`, query heads
// [h0, h1) of one KV head, keys at positions [key_lo, key_hi). partial < 0: write `out`.
struct Task {
  int64_t seq, t0, t1, h0, h1, key_lo, key_hi, partial;
};

struct Scratch {
  std::vector<float> q, acc, m, l, k, v;
  std::vector<float> run_acc, run_m, run_l;  // rows' fold over the blocks walked so far
  std::vector<const float*> k_rows, v_rows;
};

// (m, l, acc) of a row over the blocks so far ⊕ one more block's (bm, bl, bacc), left to
// right. The one place blocks are combined: in a task walking several blocks and in
// merge_partials alike, with no contraction into FMAs, so both give the same bits.
__attribute__((noinline, optimize("fp-contract=off"))) void fold_row(
    float& m, float& l, float* acc, float bm, float bl, const float* bacc, int64_t d) {
  if (bl == 0.f) return;  // the block saw no key of this row
  if (l == 0.f) {
    m = bm;
    l = bl;
    std::copy(bacc, bacc + d, acc);
    return;
  }
  const float top = std::max(m, bm);
  const float a = std::exp(m - top), b = std::exp(bm - top);
  l = l * a + bl * b;
  for (int64_t i = 0; i < d; ++i) acc[i] = acc[i] * a + bacc[i] * b;
  m = top;
}

#define FT_ALWAYS_INLINE inline __attribute__((always_inline))

FT_ALWAYS_INLINE float lanes_sum(const v8f& x) {
  v8f v = x + __builtin_shuffle(x, v8i{4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, v8i{2, 3, 0, 1, 6, 7, 4, 5});
  v += __builtin_shuffle(v, v8i{1, 0, 3, 2, 5, 4, 7, 6});
  return v[0];
}

FT_ALWAYS_INLINE float lanes_max(const v8f& x) {
  v8f t = __builtin_shuffle(x, v8i{4, 5, 6, 7, 0, 1, 2, 3});
  v8f v = x > t ? x : t;
  t = __builtin_shuffle(v, v8i{2, 3, 0, 1, 6, 7, 4, 5});
  v = v > t ? v : t;
  t = __builtin_shuffle(v, v8i{1, 0, 3, 2, 5, 4, 7, 6});
  v = v > t ? v : t;
  return v[0];
}

template <int kD>
FT_ALWAYS_INLINE float dot(const float* a, const float* b, int64_t n) {
  const int64_t len = kD > 0 ? kD : n;
  v8f s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    s0 += load8(a + i) * load8(b + i);
    s1 += load8(a + i + 8) * load8(b + i + 8);
  }
  for (; i + 8 <= len; i += 8) s0 += load8(a + i) * load8(b + i);
  float s = lanes_sum(s0 + s1);
  for (; i < len; ++i) s += a[i] * b[i];
  return s;
}

// Dots of q with four keys at once: q is loaded once, and the four lane sums share one
// shuffle-and-add reduction (a fraction of four separate horizontal sums).
template <int kD>
FT_ALWAYS_INLINE void dot4(const float* q, const float* const* k, int64_t n, float* out) {
  const int64_t len = kD > 0 ? kD : n;
  v8f a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const v8f qv = load8(q + i);
    a0 += qv * load8(k[0] + i);
    a1 += qv * load8(k[1] + i);
    a2 += qv * load8(k[2] + i);
    a3 += qv * load8(k[3] + i);
  }
  // [a lo+hi | b lo+hi], then pairs, then neighbours: lanes 0, 4, 2, 6 hold a, b, c, d
  v8f ab = __builtin_shuffle(a0, a1, v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(a0, a1, v8i{4, 5, 6, 7, 12, 13, 14, 15});
  v8f cd = __builtin_shuffle(a2, a3, v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(a2, a3, v8i{4, 5, 6, 7, 12, 13, 14, 15});
  v8f x = __builtin_shuffle(ab, cd, v8i{0, 1, 8, 9, 4, 5, 12, 13}) +
          __builtin_shuffle(ab, cd, v8i{2, 3, 10, 11, 6, 7, 14, 15});
  x += __builtin_shuffle(x, v8i{1, 0, 3, 2, 5, 4, 7, 6});
  out[0] = x[0];
  out[1] = x[4];
  out[2] = x[2];
  out[3] = x[6];
  for (; i < len; ++i) {
    for (int j = 0; j < 4; ++j) out[j] += q[i] * k[j][i];
  }
}

// acc = acc * alpha + sum_j p[j] * v[j]; with kD fixed the accumulator lives in registers.
template <int kD>
FT_ALWAYS_INLINE void scale_add_rows(float* acc, float alpha, const float* p,
                                     const float* const* v, int64_t j0, int64_t j1, int64_t d) {
  if constexpr (kD > 0) {
    v8f a[kD / 8];
    for (int i = 0; i < kD / 8; ++i) a[i] = load8(acc + 8 * i) * alpha;
    for (int64_t j = j0; j < j1; ++j) {
      for (int i = 0; i < kD / 8; ++i) a[i] += p[j] * load8(v[j] + 8 * i);
    }
    for (int i = 0; i < kD / 8; ++i) store8(acc + 8 * i, a[i]);
  } else {
    for (int64_t i = 0; i < d; ++i) acc[i] *= alpha;
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t i = 0; i < d; ++i) acc[i] += p[j] * v[j][i];
    }
  }
}

template <typename T>
void load_row(float* dst, const void* base, int64_t offset, int64_t n, float mul) {
  const T* src = static_cast<const T*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]) * mul;
}

template <typename T>
void store_row(void* base, int64_t offset, const float* src, int64_t n, float mul) {
  T* dst = static_cast<T*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = from_float<T>(src[i] * mul);
}

template <typename T>
void convert_row(float* dst, const void* src, int64_t n) {
  load_row<T>(dst, src, 0, n, 1.f);
}

__attribute__((target("avx2,f16c"))) void convert_f16_row_f16c(float* dst, const void* src, int64_t n) {
  const uint16_t* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(h[i]);
}

// e4m3fn code -> float, every code once (0x7F/0xFF are NaN: the writer never stores them).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 15, m = c & 7;
      const float a = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                             : std::ldexp(1.f + m / 8.f, e - 7);
      value[c] = (c & 0x80) ? -a : a;
    }
    value[0x7F] = value[0xFF] = std::nanf("");
  }
};

void convert_e4m3_row(float* dst, const uint8_t* src, int64_t n, float scale) {
  static const E4M3Table table;
  for (int64_t i = 0; i < n; ++i) dst[i] = table.value[src[i]] * scale;
}

// Points k_rows/v_rows [at, at + n) at keys [c0, c0 + n) of one sequence and KV head
// (converted if needed).
template <bool kDirect>
FT_ALWAYS_INLINE void gather_chunk(const Problem& p, const int32_t* table, int64_t kv_head,
                                   int64_t c0, int64_t n, int64_t at, Scratch& sc) {
  const int64_t d = p.head_dim, key_stride = p.kv_heads * d;  // between slots, in elements
  const size_t elem = p.k_scale ? 1 : p.cache_type == FloatType::kF32 ? 4 : 2;
  int64_t page = c0 / p.block_size, offset = c0 % p.block_size;
  int64_t row = ((table[page] * p.block_size + offset) * p.kv_heads + kv_head) * d;
  for (int64_t j = at; j < at + n; ++j) {
    if constexpr (kDirect) {
      sc.k_rows[j] = static_cast<const float*>(p.k) + row;
      sc.v_rows[j] = static_cast<const float*>(p.v) + row;
    } else if (p.k_scale) {   // FP8 pool: row / d is the (slot, KV head) of the scale
      convert_e4m3_row(sc.k.data() + j * d, static_cast<const uint8_t*>(p.k) + row, d,
                       p.k_scale[row / d]);
      convert_e4m3_row(sc.v.data() + j * d, static_cast<const uint8_t*>(p.v) + row, d,
                       p.v_scale[row / d]);
      sc.k_rows[j] = sc.k.data() + j * d;
      sc.v_rows[j] = sc.v.data() + j * d;
    } else {
      p.convert(sc.k.data() + j * d, static_cast<const char*>(p.k) + row * elem, d);
      p.convert(sc.v.data() + j * d, static_cast<const char*>(p.v) + row * elem, d);
      sc.k_rows[j] = sc.k.data() + j * d;
      sc.v_rows[j] = sc.v.data() + j * d;
    }
    row += key_stride;
    if (++offset == p.block_size && j + 1 < at + n) {  // next page: look its block up
      offset = 0;
      row = (table[++page] * p.block_size * p.kv_heads + kv_head) * d;
    }
  }
}

// Online-softmax update of one query row with chunk keys [j0, j1).
template <int kD>
FT_ALWAYS_INLINE void update_row(const float* q, float* acc, float& m, float& l, int64_t j0,
                                 int64_t j1, int64_t d, const Scratch& sc) {
  float s[kChunk + 8];  // local, so the compiler knows it aliases neither q nor the K rows
  const float* const* k_rows = sc.k_rows.data();
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) dot4<kD>(q, k_rows + j, d, s + j);
  for (; j < j1; ++j) s[j] = dot<kD>(q, k_rows[j], d);
  for (int i = 0; i < 8; ++i) s[j1 + i] = -INFINITY;  // pad: max ignores it, exp gives 0
  v8f top = v8f{} - INFINITY;
  for (j = j0; j < j1; j += 8) {
    v8f x = load8(s + j);
    top = x > top ? x : top;
  }
  const float m_new = std::max(m, lanes_max(top));
  v8f sum = {};
  for (j = j0; j < j1; j += 8) {
    v8f e = exp8(load8(s + j) - m_new);
    store8(s + j, e);
    sum += e;
  }
  const float alpha = std::exp(m - m_new);  // 0 on the first chunk (m = -inf)
  l = l * alpha + lanes_sum(sum);
  m = m_new;
  scale_add_rows<kD>(acc, alpha, s, sc.v_rows.data(), j0, j1, d);
}

template <int kD, bool kDirect>
FT_ALWAYS_INLINE void run_task(const Problem& p, const Task& task, Scratch& sc) {
  const int64_t d = p.head_dim, heads = task.h1 - task.h0;
  const int64_t rows = (task.t1 - task.t0) * heads, kv_head = task.h0 / p.group;
  const int64_t q_start = p.query_start[task.seq];
  const int64_t first_pos = p.seq_lens[task.seq] - (p.query_start[task.seq + 1] - q_start);
  const int32_t* table = p.block_tables + task.seq * p.max_blocks;
  sc.q.resize(rows * d);
  sc.acc.resize(rows * d);
  sc.m.resize(rows);
  sc.l.resize(rows);
  sc.run_acc.resize(rows * d);
  sc.run_m.assign(rows, -INFINITY);
  sc.run_l.assign(rows, 0.f);
  for (int64_t r = 0; r < rows; ++r) {  // row r = (token t0 + r / heads, head h0 + r % heads)
    const int64_t at = (q_start + task.t0 + r / heads) * p.q_token_stride + (task.h0 + r % heads) * d;
    FT_DISPATCH_FLOAT(p.q_type, T, load_row<T>(sc.q.data() + r * d, p.q, at, d, p.scale));
  }
  // blocks and chunks start at absolute multiples of their size (see the top of the file)
  for (int64_t b0 = task.key_lo / kSplitKeys * kSplitKeys; b0 < task.key_hi; b0 += kSplitKeys) {
    std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
    std::fill(sc.m.begin(), sc.m.end(), -INFINITY);
    std::fill(sc.l.begin(), sc.l.end(), 0.f);
    const int64_t lo = std::max(b0, task.key_lo), hi = std::min(b0 + kSplitKeys, task.key_hi);
    for (int64_t c0 = lo / kChunk * kChunk; c0 < hi; c0 += kChunk) {
      // key c0 + j is row j of the chunk; only keys from lo on are read (a window's earlier
      // pages may be gone), and no row looks before its own window
      const int64_t c_lo = std::max(c0, lo), c_hi = std::min(c0 + kChunk, hi);
      gather_chunk<kDirect>(p, table, kv_head, c_lo, c_hi - c_lo, c_lo - c0, sc);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = first_pos + task.t0 + r / heads;  // causal: keys 0..pos are visible
        const int64_t row_lo = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
        const int64_t j0 = std::max(c_lo, row_lo) - c0, j1 = std::min(c_hi, pos + 1) - c0;
        if (j0 < j1) update_row<kD>(sc.q.data() + r * d, sc.acc.data() + r * d, sc.m[r], sc.l[r], j0, j1, d, sc);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      fold_row(sc.run_m[r], sc.run_l[r], sc.run_acc.data() + r * d, sc.m[r], sc.l[r],
               sc.acc.data() + r * d, d);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (task.partial >= 0) {
      float* part = p.partials + (task.partial * kTileRows + r) * (d + 2);
      part[0] = sc.run_m[r];
      part[1] = sc.run_l[r];
      std::copy(sc.run_acc.data() + r * d, sc.run_acc.data() + (r + 1) * d, part + 2);
      continue;
    }
    const int64_t at = (q_start + task.t0 + r / heads) * p.out_token_stride + (task.h0 + r % heads) * d;
    FT_DISPATCH_FLOAT(p.out_type, T, store_row<T>(p.out, at, sc.run_acc.data() + r * d, d, 1.f / sc.run_l[r]));
  }
}

template <int kD>
FT_ALWAYS_INLINE void run_tasks_body(const Problem& p, const Task* tasks, int64_t n) {
  thread_local Scratch sc;
  sc.k_rows.resize(kChunk);
  sc.v_rows.resize(kChunk);
  sc.k.resize(kChunk * p.head_dim);
  sc.v.resize(kChunk * p.head_dim);
  for (int64_t i = 0; i < n; ++i) {
    if (p.cache_type == FloatType::kF32 && !p.k_scale) {
      run_task<kD, true>(p, tasks[i], sc);
    } else {
      run_task<kD, false>(p, tasks[i], sc);
    }
  }
}

#define FT_TASK_RUNNERS(SUFFIX, ATTRS)                                                   \
  ATTRS void run_tasks_##SUFFIX(const Problem& p, const Task* tasks, int64_t n) {        \
    if (p.head_dim == 64) {                                                              \
      run_tasks_body<64>(p, tasks, n);                                                   \
    } else if (p.head_dim == 128) {                                                      \
      run_tasks_body<128>(p, tasks, n);                                                  \
    } else {                                                                             \
      run_tasks_body<0>(p, tasks, n);                                                    \
    }                                                                                    \
  }
FT_TASK_RUNNERS(avx2, __attribute__((target("avx2,fma"))))
FT_TASK_RUNNERS(baseline, )
#undef FT_TASK_RUNNERS

struct CpuFeatures {
  bool avx2, f16c;
};

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    __builtin_cpu_init();
    return CpuFeatures{__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                       __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")};
  }();
  return f;
}

// Tasks of (sequence, token tile, KV head); when they are too few to fill the cores, each key
// range is split and `merges` records the groups to combine afterwards.
struct Merge {
  int64_t seq, t0, t1, h0, h1, first, count;
};

void build_tasks(const Problem& p, int64_t threads, std::vector<Task>& tasks,
                 std::vector<Merge>& merges) {
  tasks.clear();
  merges.clear();
  const int64_t tile = std::max<int64_t>(1, kTileRows / p.group);
  int64_t groups = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    groups += (p.query_start[b + 1] - p.query_start[b] + tile - 1) / tile * p.kv_heads;
  }
  const int64_t wanted_splits = groups > 0 ? (4 * threads + groups - 1) / groups : 1;
  int64_t partial = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = p.query_start[b + 1] - p.query_start[b];
    const int64_t first_pos = p.seq_lens[b] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t t1 = std::min(q_len, t0 + tile);
      const int64_t hi = first_pos + t1;  // keys [lo, hi) cover every row of the tile
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first_pos + t0 - p.window + 1) : 0;
      // a split task walks exactly one block: folded in order by merge_partials, the blocks
      // give the bits one task walking them all would
      const int64_t first_block = lo / kSplitKeys, blocks = (hi - 1) / kSplitKeys - first_block + 1;
      const bool split = wanted_splits > 1 && blocks > 1;
      for (int64_t h = 0; h < p.q_heads; h += p.group) {
        if (!split) {
          tasks.push_back({b, t0, t1, h, h + p.group, lo, hi, -1});
          continue;
        }
        merges.push_back({b, t0, t1, h, h + p.group, partial, blocks});
        for (int64_t i = 0; i < blocks; ++i) {
          const int64_t b0 = (first_block + i) * kSplitKeys;
          tasks.push_back({b, t0, t1, h, h + p.group, std::max(lo, b0),
                           std::min(hi, b0 + kSplitKeys), partial++});
        }
      }
    }
  }
}

// (query row, key) pairs over all tasks; a row sees at most the task's key range.
int64_t total_work(const Problem& p, const std::vector<Task>& tasks) {
  int64_t work = 0;
  for (const Task& t : tasks) work += (t.t1 - t.t0) * (t.h1 - t.h0) * (t.key_hi - t.key_lo);
  return work;
}

// Each row's blocks folded left to right (fold_row), then out = acc / l.
void merge_partials(const Problem& p, const std::vector<Merge>& merges) {
  const int64_t d = p.head_dim;
  std::vector<float> acc(d);
  for (const Merge& g : merges) {
    const int64_t heads = g.h1 - g.h0, rows = (g.t1 - g.t0) * heads;
    const int64_t q_start = p.query_start[g.seq];
    for (int64_t r = 0; r < rows; ++r) {
      float m = -INFINITY, l = 0.f;
      for (int64_t i = 0; i < g.count; ++i) {
        const float* part = p.partials + ((g.first + i) * kTileRows + r) * (d + 2);
        fold_row(m, l, acc.data(), part[0], part[1], part + 2, d);
      }
      const int64_t at = (q_start + g.t0 + r / heads) * p.out_token_stride + (g.h0 + r % heads) * d;
      FT_DISPATCH_FLOAT(p.out_type, T, store_row<T>(p.out, at, acc.data(), d, 1.f / l));
    }
  }
}

void run_attention(Problem& p, int64_t num_blocks);

void paged_attention(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                     TensorView block_tables, TensorView seq_lens, TensorView query_start_loc,
                     int64_t block_size, double scale, int64_t sliding_window) {
  Problem p = attention::check_problem(out, q, k_cache, v_cache, block_size, sliding_window);
  attention::fill_problem(p, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          block_size, scale, sliding_window);
  run_attention(p, k_cache.size(0) / block_size);
}

// The FP8 pool: K/V uint8 e4m3 codes [S, Hk, D], k_scale/v_scale float32 [S, Hk].
void paged_attention_fp8(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                         TensorView k_scale, TensorView v_scale, TensorView block_tables,
                         TensorView seq_lens, TensorView query_start_loc, int64_t block_size,
                         double scale, int64_t sliding_window) {
  Problem p = attention::check_problem(out, q, k_cache, v_cache, block_size, sliding_window,
                                       /*fp8=*/true);
  attention::fill_problem(p, out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          block_size, scale, sliding_window);
  attention::check_fp8_scales(p, k_cache, k_scale, v_scale);
  run_attention(p, k_cache.size(0) / block_size);
}

void run_attention(Problem& p, int64_t num_blocks) {
  attention::check_sequences(p);
  attention::check_block_ids(p, num_blocks);
  const CpuFeatures& cpu = cpu_features();
  p.convert = p.cache_type == FloatType::kBF16 ? convert_row<bf16>
              : cpu.f16c                      ? convert_f16_row_f16c
                                              : convert_row<f16>;
  thread_local std::vector<Task> tasks;
  thread_local std::vector<Merge> merges;
  thread_local std::vector<float> partials;
  build_tasks(p, thread_pool().num_threads(), tasks, merges);
  int64_t n_partials = 0;
  for (const Merge& g : merges) n_partials += g.count;
  partials.resize(n_partials * kTileRows * (p.head_dim + 2));
  p.partials = partials.data();
  const Task* list = tasks.data();
  auto run = [&](int64_t i0, int64_t i1) {
    if (cpu.avx2) {
      run_tasks_avx2(p, list + i0, i1 - i0);
    } else {
      run_tasks_baseline(p, list + i0, i1 - i0);
    }
  };
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  if (total_work(p, tasks) < kMinPoolWork) {
    run(0, n_tasks);
  } else {
    parallel_for(n_tasks, 1, run);
  }
  merge_partials(p, merges);
}

int64_t set_num_threads(int64_t n) {
  thread_pool().set_num_threads(static_cast<int>(n));
  return thread_pool().num_threads();
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(paged_attention, freetoken::paged_attention);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(paged_attention_fp8, freetoken::paged_attention_fp8);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_num_threads, freetoken::set_num_threads);
