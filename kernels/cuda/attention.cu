// Causal attention of new tokens over the paged KV pool, one entry point for mixed batches.
//
// Two kernels, chosen on the host from shapes alone (no device->host sync, so the call can be
// captured in a CUDA graph):
//  * tiled (bf16/fp16, every batch): tiles of 64 query rows packed as (token, head of the GQA
//    group) pairs, so each K/V tile is loaded once for the whole group; keys stream through
//    shared memory in tiles of 64 (32 for head_dim 256) with cp.async; tensor-core mma and an
//    online softmax. Decode rows fill only the first warp(s); the rest skip the math.
//  * decode (float32, or a q whose rows are not 16-byte aligned): CUDA-core dot products,
//    one block per (split, kv head, sequence) serving up to 8 query heads; it loops over a
//    sequence's new tokens, so it is correct for any query length.
// A decode batch (T == B) with few blocks splits each KV range (flash-decoding); a second
// kernel merges the splits from the caller's workspace.
// paged_attention_fp8 runs the same kernels over the FP8 pool (store_kv_fp8: e4m3 codes and a
// float scale per (slot, KV head)); a pool policy (PlainPool, Fp8Pool) is all that differs.
//
// NOTE: one source file per registry kernel (a header would re-key every kernel's cache
// entry), hence the length.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "freetoken/cuda_common.cuh"
#include "freetoken/fp8_kv.cuh"
#include "freetoken/fp8_words.h"
#include "freetoken/mma_tiles.cuh"

namespace freetoken {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -__builtin_huge_valf();
constexpr int kThreads = 128;       // both kernels: 4 warps
constexpr int kDecodeMaxGroup = 8;  // query heads per decode block
constexpr int kTileMaxGroup = 16;   // query heads per tile
constexpr int kTileRows = 64;       // query rows (token, head) per tile
constexpr int kMaxSplits = 64;
constexpr int kMinSplitKeys = 64;
#if defined(__HIP_PLATFORM_AMD__)
constexpr bool kHasTensorCorePath = false;
#else
constexpr bool kHasTensorCorePath = true;
#endif

struct AttnParams {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;  // FP8 pool: [S, Hk] row scales (unused for a pool of T)
  const float* v_scale;
  const int* block_tables;
  const int* seq_lens;
  const int* query_start_loc;
  float* part_o;   // [T, Hq, splits, D] split results (normalized), when splits > 1
  float* part_ml;  // [T, Hq, splits, 2] their running max (log2 units) and sum
  int64_t q_stride_t, q_stride_h, o_stride_t, o_stride_h, bt_stride;
  int num_seqs, q_heads, kv_heads, group, head_chunk, chunks, block_size, window, splits;
  float scale_log2;
};

// Keys per split of a `range`-key context: at least kMinSplitKeys, so a short context fills its
// first few splits and leaves the rest empty (the merge skips them), and the partition, hence
// the rounding, is the same at any split count the table width allows (CUDA graphs capture
// the widest tables; eager steps pass narrower ones).
__device__ __forceinline__ int split_keys(int range, int splits) {
  return max(kMinSplitKeys, (max(range, 0) + splits - 1) / splits);
}

__device__ __forceinline__ int64_t slot_of(const int* bt, int key, int block_size) {
  return static_cast<int64_t>(bt[key / block_size]) * block_size + key % block_size;
}

// ---------------------------------------------------------------- the pool's rows

// How the kernels read K and V, one policy per pool layout. A chunk is the kVec elements of a
// row that one lane loads at once (decode); row_scale is what a (slot, KV head) row's decoded
// values are multiplied by. The decode kernel folds it into the row's dot product (K) and its
// probability (V); the tiled kernel converts whole tiles to T (load_kv_tile).

// Rows of T, q's dtype (store_kv). row_scale is 1: the multiplications fold away, so this path
// computes exactly what it did before the FP8 pool.
template <typename T>
struct PlainPool {
  static constexpr int kVec = 16 / sizeof(T);  // one 16-byte load
  using Chunk = Vec<T, kVec>;
  static __device__ __forceinline__ Chunk load(const void* cache, int64_t elem) {
    return load_vec<T, kVec>(static_cast<const T*>(cache) + elem);
  }
  static __device__ __forceinline__ void decode(const Chunk& c, float* f) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) f[e] = to_float(c.v[e]);
  }
  static __device__ __forceinline__ float row_scale(const float*, int64_t) { return 1.f; }
  static constexpr bool kPredecode = false;  // converted where used: no float copy of the rows
};

// e4m3 codes, one byte each, and a float scale per row (store_kv_fp8).
struct Fp8Pool {
  // 8 codes (8 bytes) per load: the lane layout, hence the registers per lane, of a 16-bit
  // pool (16 codes would double each lane's q and accumulator registers).
  static constexpr int kVec = 8;
  using Chunk = Vec<uint32_t, 2>;
  static __device__ __forceinline__ Chunk load(const void* cache, int64_t elem) {
    return load_vec<uint32_t, 2>(
        reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(cache) + elem));
  }
  static __device__ __forceinline__ void decode(const Chunk& c, float* f) {
    fp8::e4m3x4_div256(c.v[0], f);
    fp8::e4m3x4_div256(c.v[1], f + 4);
  }
  // decode leaves out 2^8 (exact either side: code / 256 * (scale * 256) == code * scale)
  static __device__ __forceinline__ float row_scale(const float* scales, int64_t row) {
    return scales[row] * 256.f;
  }
  static constexpr bool kPredecode = true;  // four codes decode together: once per chunk
};

// Element e of a lane's share of a row: from the decoded floats (kPredecode) or converted from
// the loaded chunks where it is used, as the 16-bit pool always was (no registers for a float
// copy of its K and V rows).
template <typename Pool, int V>
__device__ __forceinline__ float row_elem(const typename Pool::Chunk* raw, const float* decoded,
                                          int e) {
  if constexpr (Pool::kPredecode) {
    return decoded[e];
  } else {
    return to_float(raw[e / V].v[e % V]);
  }
}

// ---------------------------------------------------------------- decode

// Lane layout: a "key group" of LANES lanes reads one key row in chunks of VEC elements (16
// bytes of a pool of T); lane li owns dims (v * LANES + li) * VEC + e. Each group keeps its own
// online-softmax state, merged through shared memory at the end.
template <typename Pool, int D>
struct DecodeShape {
  static constexpr int kVec = Pool::kVec;
  static constexpr int kLanes = D / kVec < 32 ? D / kVec : 32;
  static constexpr int kVpl = D / (kVec * kLanes);
  static constexpr int kEpl = kVpl * kVec;  // elements per lane
  static constexpr int kGroups = (kThreads / 32) * (32 / kLanes);
  static constexpr int kUnroll = 2;  // keys per group per step (more loads in flight)
};

template <typename T, int D, typename Pool>
__device__ __forceinline__ void decode_merge_and_store(const AttnParams& p, int t, int h0, int gc,
                                                       float (*s_m)[kDecodeMaxGroup],
                                                       float (*s_l)[kDecodeMaxGroup],
                                                       float (*s_acc)[kDecodeMaxGroup][D]) {
  using S = DecodeShape<Pool, D>;
  for (int idx = threadIdx.x; idx < gc * D; idx += blockDim.x) {
    int g = idx / D, d = idx - g * D;
    float m = kNegInf;
    for (int j = 0; j < S::kGroups; ++j) m = fmaxf(m, s_m[j][g]);
    float l = 0.f, o = 0.f;
    if (m != kNegInf) {
      for (int j = 0; j < S::kGroups; ++j) {
        float w = exp2f(s_m[j][g] - m);
        l += s_l[j][g] * w;
        o += s_acc[j][g][d] * w;
      }
    }
    float val = l > 0.f ? o / l : 0.f;
    int64_t row = static_cast<int64_t>(t) * p.q_heads + h0 + g;
    if (p.splits == 1) {
      static_cast<T*>(p.out)[t * p.o_stride_t + (h0 + g) * p.o_stride_h + d] = from_float<T>(val);
    } else {
      int64_t part = row * p.splits + blockIdx.x;
      p.part_o[part * D + d] = val;
      if (d == 0) {
        p.part_ml[part * 2] = m;
        p.part_ml[part * 2 + 1] = l;
      }
    }
  }
}

template <typename T, int D, typename Pool>
__global__ void __launch_bounds__(kThreads) decode_kernel(AttnParams p) {
  using S = DecodeShape<Pool, D>;
  constexpr int G = kDecodeMaxGroup, E = S::kEpl, U = S::kUnroll, V = S::kVec;
  __shared__ float s_m[S::kGroups][G], s_l[S::kGroups][G];
  __shared__ float s_acc[S::kGroups][G][D];

  const int kvh = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks, b = blockIdx.z;
  const int h0 = kvh * p.group + chunk * p.head_chunk;
  const int gc = min(p.head_chunk, p.group - chunk * p.head_chunk);
  const int lane = threadIdx.x % 32;
  const int gi = (threadIdx.x / 32) * (32 / S::kLanes) + lane / S::kLanes;
  const int li = lane % S::kLanes;
  const int ctx = p.seq_lens[b];
  const int qs = p.query_start_loc[b], qe = p.query_start_loc[b + 1];
  const int* bt = p.block_tables + b * p.bt_stride;

  for (int t = qs; t < qe; ++t) {
    const int pos = ctx - (qe - t);
    const int lo = p.window > 0 ? max(0, pos - p.window + 1) : 0;
    const int per = split_keys(pos + 1 - lo, p.splits);
    const int ks = lo + blockIdx.x * per, ke = min(pos + 1, ks + per);

    float q[G][E], m[G], l[G], acc[G][E];
    const T* qrow = static_cast<const T*>(p.q) + t * p.q_stride_t;
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = kNegInf;
      l[g] = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        int d = ((e / V) * S::kLanes + li) * V + e % V;
        q[g][e] = g < gc ? to_float(qrow[(h0 + g) * p.q_stride_h + d]) * p.scale_log2 : 0.f;
        acc[g][e] = 0.f;
      }
    }
    // Uniform trip count across the block: every lane reaches the shuffles.
    for (int base = ks; base < ke; base += S::kGroups * U) {
      typename Pool::Chunk kv[U][S::kVpl], vv[U][S::kVpl];
      float k_scale[U], v_scale[U];
      bool valid[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        int key = base + u * S::kGroups + gi;
        valid[u] = key < ke;
        int64_t row = slot_of(bt, valid[u] ? key : ks, p.block_size) * p.kv_heads + kvh;
        k_scale[u] = Pool::row_scale(p.k_scale, row);
        v_scale[u] = Pool::row_scale(p.v_scale, row);
#pragma unroll
        for (int v = 0; v < S::kVpl; ++v) {
          kv[u][v] = Pool::load(p.k_cache, row * D + (v * S::kLanes + li) * V);
          vv[u][v] = Pool::load(p.v_cache, row * D + (v * S::kLanes + li) * V);
        }
      }
      constexpr int DE = Pool::kPredecode ? E : 1;  // decoded elements kept per row
      float s[U][G], vf[U][DE];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        float kf[DE];  // decoded once for the group's heads
        if constexpr (Pool::kPredecode) {
#pragma unroll
          for (int v = 0; v < S::kVpl; ++v) {
            Pool::decode(kv[u][v], kf + v * V);
            Pool::decode(vv[u][v], vf[u] + v * V);
          }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          if (g >= gc) continue;  // gc is uniform over the block: the shuffles stay converged
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) dot += q[g][e] * row_elem<Pool, V>(kv[u], kf, e);
#pragma unroll
          for (int off = S::kLanes / 2; off > 0; off >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, off);
          s[u][g] = valid[u] ? dot * k_scale[u] : kNegInf;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (g >= gc) continue;
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][g]);
        if (mx == kNegInf) continue;
        float alpha = exp2f(m[g] - mx);
        l[g] *= alpha;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          float pr = exp2f(s[u][g] - mx);  // 0 for an invalid key
          l[g] += pr;
          float pv = pr * v_scale[u];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] += pv * row_elem<Pool, V>(vv[u], vf[u], e);
        }
        m[g] = mx;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      if (g >= gc) continue;
      if (li == 0) {
        s_m[gi][g] = m[g];
        s_l[gi][g] = l[g];
      }
#pragma unroll
      for (int e = 0; e < E; ++e) s_acc[gi][g][((e / V) * S::kLanes + li) * V + e % V] = acc[g][e];
    }
    __syncthreads();
    decode_merge_and_store<T, D, Pool>(p, t, h0, gc, s_m, s_l, s_acc);
    __syncthreads();  // the next token reuses the shared arrays
  }
}

// Combines the splits of each (token, head): weights exp2(m_s - max) * l_s. Each split's
// (max, sum) is read once, by one thread (splits <= kMaxSplits <= D); the weights go through
// shared memory, and an empty split (weight 0: no keys) is skipped, so a short context pays
// for its few filled splits only. The sums run in split order, as a serial merge would.
template <typename T, int D>
__global__ void __launch_bounds__(D) merge_splits_kernel(AttnParams p, int num_tokens) {
  static_assert(D >= kMaxSplits && D % 32 == 0, "one thread per split, whole warps");
  __shared__ float s_weight[kMaxSplits];
  __shared__ float s_warp_max[D / 32];
  int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
  int64_t base = (static_cast<int64_t>(t) * p.q_heads + h) * p.splits;
  float m_s = kNegInf, l_s = 0.f;
  if (d < p.splits) {
    m_s = p.part_ml[(base + d) * 2];
    l_s = p.part_ml[(base + d) * 2 + 1];
  }
  float m = m_s;
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (d % 32 == 0) s_warp_max[d / 32] = m;
  __syncthreads();
  m = s_warp_max[0];
#pragma unroll
  for (int i = 1; i < D / 32; ++i) m = fmaxf(m, s_warp_max[i]);
  if (d < p.splits) s_weight[d] = m == kNegInf ? 0.f : exp2f(m_s - m) * l_s;
  __syncthreads();
  float l = 0.f, o = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    float w = s_weight[s];
    if (w != 0.f) {
      l += w;
      o += w * p.part_o[(base + s) * D + d];
    }
  }
  static_cast<T*>(p.out)[t * p.o_stride_t + h * p.o_stride_h + d] =
      from_float<T>(l > 0.f ? o / l : 0.f);
}

#if !defined(__HIP_PLATFORM_AMD__)
// NOTE: the tiled kernel is PTX (cp.async, ldmatrix, mma.sync); the HIP build serves every
// batch with the decode kernel, which loops over a sequence's new tokens (correct, slower).
// ---------------------------------------------------------------- tiled (tensor cores)

template <int D>
struct TileShape {
  static constexpr int kKeys = D == 256 ? 32 : 64;  // keys per tile
  // Shared-memory row pitch: 16 bytes of padding keep ldmatrix reads free of bank conflicts.
  static constexpr int kPitch = D + 8;
  static constexpr int kSmemBytes = (kTileRows + 2 * kKeys) * kPitch * 2;
};

// The tile's sequence: tiles of sequence b start at query_start_loc[b] / tokens_per_tile + b.
__device__ __forceinline__ int find_sequence(const int* qsl, int num_seqs, int tpt, int tile) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (qsl[mid] / tpt + mid <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Copies this tile's K or V rows (keys whose slot is -1 are zero-filled) with cp.async.
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(PlainPool<T>, T* dst, const void* cache,
                                             const float*, const int64_t* slots, int kv_heads,
                                             int kvh) {
  using S = TileShape<D>;
  constexpr int kChunks = D / 8;
  const T* base = static_cast<const T*>(cache);
  for (int i = threadIdx.x; i < S::kKeys * kChunks; i += kThreads) {
    int n = i / kChunks, c = i - n * kChunks;
    int64_t slot = slots[n];
    const T* src = slot >= 0 ? base + (slot * kv_heads + kvh) * D + c * 8 : base;
    cp_async16(dst + n * S::kPitch + c * 8, src, slot >= 0);
  }
}

// The FP8 pool's rows, converted to T into the same tile layout. Synchronous: cp.async copies
// bytes, the conversion needs registers. A thread loads kBatch chunks before converting the
// first, so that many loads are in flight together (all of them would cost registers the mma
// loop needs: fewer blocks per SM).
template <typename T, int D>
__device__ __forceinline__ void load_kv_tile(Fp8Pool, T* dst, const void* cache,
                                             const float* scales, const int64_t* slots,
                                             int kv_heads, int kvh) {
  using S = TileShape<D>;
  constexpr int kChunks = D / Fp8Pool::kVec, kBatch = 4;
  static_assert(Fp8Pool::kVec == 8 && S::kKeys * kChunks % (kThreads * kBatch) == 0,
                "a chunk is 8 codes -> 16 bytes of T; whole batches per thread");
  for (int i0 = threadIdx.x; i0 < S::kKeys * kChunks; i0 += kThreads * kBatch) {
    Fp8Pool::Chunk codes[kBatch];
    float scale[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      int i = i0 + j * kThreads, n = i / kChunks, c = i - n * kChunks;
      int64_t slot = slots[n], row = (slot >= 0 ? slot : 0) * kv_heads + kvh;
      codes[j] = Fp8Pool::load(cache, row * D + c * Fp8Pool::kVec);
      // no key (slot -1): slot 0's codes, finite, times 0 -- the zero fill of cp.async
      scale[j] = slot >= 0 ? Fp8Pool::row_scale(scales, row) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      int i = i0 + j * kThreads, n = i / kChunks, c = i - n * kChunks;
      float f[Fp8Pool::kVec];
      Fp8Pool::decode(codes[j], f);
      Vec<uint32_t, 4> packed;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        packed.v[e] = pack2<T>(f[2 * e] * scale[j], f[2 * e + 1] * scale[j]);
      }
      store_vec<uint32_t, 4>(reinterpret_cast<uint32_t*>(dst + n * S::kPitch + c * 8), packed);
    }
  }
}

// Per-warp state of 16 query rows: this lane holds rows r0 = 16 * warp + lane / 4 and r0 + 8.
template <int D>
struct RowState {
  float o[D / 8][4];
  float m0, m1, l0, l1;  // running max (log2 units) and this lane's share of the row sums
};

// S = Q K^T for the warp's 16 rows, masked and folded into the online softmax; on return
// s holds the probabilities P (unnormalized) of this key tile.
template <typename T, int D, int BN>
__device__ __forceinline__ void tile_scores(const AttnParams& p, const T* sQ, const T* sK,
                                            int n0, int ke, int pos0, int pos1,
                                            float (&s)[BN / 8][4], RowState<D>& st) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  warp_scores<T, D, BN, TileShape<D>::kPitch>(sQ, sK, warp * 16, s);
  // A row lives in the 4 lanes of a quad: reduce the tile max over them.
  float mx0 = kNegInf, mx1 = kNegInf;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      int key = n0 + nt * 8 + tq * 2 + (e & 1);
      int pos = e < 2 ? pos0 : pos1;
      bool ok = key <= pos && key < ke && (p.window <= 0 || key > pos - p.window);
      s[nt][e] = ok ? s[nt][e] * p.scale_log2 : kNegInf;
    }
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
  float new0 = fmaxf(st.m0, mx0), new1 = fmaxf(st.m1, mx1);
  float base0 = new0 == kNegInf ? 0.f : new0, base1 = new1 == kNegInf ? 0.f : new1;
  float alpha0 = exp2f(st.m0 - base0), alpha1 = exp2f(st.m1 - base1);
  st.m0 = new0;
  st.m1 = new1;
  st.l0 *= alpha0;
  st.l1 *= alpha1;
#pragma unroll
  for (int nt = 0; nt < BN / 8; ++nt) {
    s[nt][0] = exp2f(s[nt][0] - base0);
    s[nt][1] = exp2f(s[nt][1] - base0);
    s[nt][2] = exp2f(s[nt][2] - base1);
    s[nt][3] = exp2f(s[nt][3] - base1);
    st.l0 += s[nt][0] + s[nt][1];
    st.l1 += s[nt][2] + s[nt][3];
  }
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    st.o[dt][0] *= alpha0;
    st.o[dt][1] *= alpha0;
    st.o[dt][2] *= alpha1;
    st.o[dt][3] *= alpha1;
  }
}

// O += P V (freetoken/mma_tiles.cuh).
template <typename T, int D, int BN>
__device__ __forceinline__ void tile_values(const T* sV, const float (&s)[BN / 8][4],
                                            RowState<D>& st) {
  warp_values<T, D, BN, TileShape<D>::kPitch>(sV, s, st.o);
}

// Writes the warp's valid rows: the normalized output, or this split's partial result.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const AttnParams& p, RowState<D>& st, int row_token0,
                                           int ntok, int gcap, int h0, int gc) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    st.l0 += __shfl_xor_sync(0xffffffffu, st.l0, off);
    st.l1 += __shfl_xor_sync(0xffffffffu, st.l1, off);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    int r = warp * 16 + lane / 4 + half * 8;
    int tok = r / gcap, g = r - tok * gcap;
    if (tok >= ntok || g >= gc) continue;
    float l = half ? st.l1 : st.l0, m = half ? st.m1 : st.m0;
    float inv = l > 0.f ? 1.f / l : 0.f;
    int64_t t = row_token0 + tok;
    if (p.splits == 1) {
      T* orow = static_cast<T*>(p.out) + t * p.o_stride_t + (h0 + g) * p.o_stride_h + tq * 2;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(orow + dt * 8) =
            pack2<T>(st.o[dt][half * 2] * inv, st.o[dt][half * 2 + 1] * inv);
      }
    } else {
      int64_t part = (t * p.q_heads + h0 + g) * p.splits + blockIdx.z;
      float* orow = p.part_o + part * D + tq * 2;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<float2*>(orow + dt * 8) =
            make_float2(st.o[dt][half * 2] * inv, st.o[dt][half * 2 + 1] * inv);
      }
      if (tq == 0) {
        p.part_ml[part * 2] = m;
        p.part_ml[part * 2 + 1] = l;
      }
    }
  }
}

// Grid: (query tiles, kv heads * head chunks, KV splits). Warps whose 16 rows are all padding
// (decode: one token per sequence) skip the math but still share the loads and barriers.
template <typename T, int D, typename Pool>
__global__ void __launch_bounds__(kThreads) tiled_kernel(AttnParams p) {
  using S = TileShape<D>;
  constexpr int BN = S::kKeys, LD = S::kPitch;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kTileRows * LD;
  T* sV = sK + BN * LD;
  __shared__ int64_t s_slot[BN];

  const int gcap = p.head_chunk, tpt = kTileRows / gcap;  // tokens per tile
  const int b = find_sequence(p.query_start_loc, p.num_seqs, tpt, blockIdx.x);
  const int qs = p.query_start_loc[b], q_len = p.query_start_loc[b + 1] - qs;
  const int tok0 = (static_cast<int>(blockIdx.x) - (qs / tpt + b)) * tpt;
  if (tok0 >= q_len) return;  // whole block leaves together
  const int ntok = min(tpt, q_len - tok0);
  const int kvh = blockIdx.y / p.chunks, chunk = blockIdx.y % p.chunks;
  const int h0 = kvh * p.group + chunk * gcap;
  const int gc = min(gcap, p.group - chunk * gcap);
  const int p_first = p.seq_lens[b] - q_len + tok0;
  const int kv_lo = p.window > 0 ? max(0, p_first - p.window + 1) : 0;
  const int kv_hi = p_first + ntok;  // exclusive
  const int per = split_keys(kv_hi - kv_lo, p.splits);
  const int ks = kv_lo + static_cast<int>(blockIdx.z) * per, ke = min(kv_hi, ks + per);
  const int* bt = p.block_tables + b * p.bt_stride;
  const int warp = threadIdx.x / 32;
  const bool active = warp * 16 < ntok * gcap;

  // Q rows: r -> (token r / gcap, head r % gcap).
  const T* qbase = static_cast<const T*>(p.q);
  for (int i = threadIdx.x; i < kTileRows * (D / 8); i += kThreads) {
    int r = i / (D / 8), c = i - r * (D / 8);
    int tok = r / gcap, g = r - tok * gcap;
    bool ok = tok < ntok && g < gc;
    const T* src = ok ? qbase + (qs + tok0 + tok) * p.q_stride_t + (h0 + g) * p.q_stride_h + c * 8
                      : qbase;
    cp_async16(sQ + r * LD + c * 8, src, ok);
  }
  cp_async_commit();

  const int r0 = warp * 16 + (threadIdx.x % 32) / 4;
  const int pos0 = p_first + r0 / gcap, pos1 = p_first + (r0 + 8) / gcap;
  RowState<D> st;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) st.o[dt][0] = st.o[dt][1] = st.o[dt][2] = st.o[dt][3] = 0.f;
  st.m0 = st.m1 = kNegInf;
  st.l0 = st.l1 = 0.f;

  for (int n0 = ks; n0 < ke; n0 += BN) {
    if (threadIdx.x < BN) {
      int key = n0 + threadIdx.x;
      s_slot[threadIdx.x] = key < ke ? slot_of(bt, key, p.block_size) : -1;
    }
    __syncthreads();
    load_kv_tile<T, D>(Pool{}, sK, p.k_cache, p.k_scale, s_slot, p.kv_heads, kvh);
    cp_async_commit();  // (an empty group for the synchronous FP8 loads)
    load_kv_tile<T, D>(Pool{}, sV, p.v_cache, p.v_scale, s_slot, p.kv_heads, kvh);
    cp_async_commit();
    cp_async_wait<1>();  // Q and K landed; V may still be in flight
    __syncthreads();
    float s[BN / 8][4] = {};
    if (active) tile_scores<T, D, BN>(p, sQ, sK, n0, ke, pos0, pos1, s, st);
    cp_async_wait<0>();
    __syncthreads();
    if (active) tile_values<T, D, BN>(sV, s, st);
  }
  cp_async_wait<0>();  // nothing stays in flight past the end (an empty key range)
  if (active) store_rows<T, D>(p, st, qs + tok0, ntok, gcap, h0, gc);
}

#endif  // !__HIP_PLATFORM_AMD__

// ---------------------------------------------------------------- host side

template <typename T, int D>
void launch_merge(const AttnParams& p, int num_tokens, cudaStream_t stream) {
  if (p.splits == 1) return;
  merge_splits_kernel<T, D><<<dim3(num_tokens, p.q_heads), D, 0, stream>>>(p, num_tokens);
  check_launch("paged_attention (merge splits)");
}

template <typename T, int D, typename Pool>
void launch_decode(const AttnParams& p, int num_tokens, cudaStream_t stream) {
  dim3 grid(p.splits, p.kv_heads * p.chunks, p.num_seqs);
  decode_kernel<T, D, Pool><<<grid, kThreads, 0, stream>>>(p);
  check_launch("paged_attention (decode)");
  launch_merge<T, D>(p, num_tokens, stream);
}

template <typename T, int D, typename Pool>
void launch_tiled(const AttnParams& p, int num_tokens, cudaStream_t stream) {
#if defined(__HIP_PLATFORM_AMD__)
  TVM_FFI_ICHECK(false) << "internal: the HIP build has no tensor-core path";
#else
  if constexpr (std::is_same_v<T, float>) {
    TVM_FFI_ICHECK(false) << "internal: float32 has no tensor-core path";
  } else {
    using S = TileShape<D>;
    int tpt = kTileRows / p.head_chunk;
    dim3 grid(num_tokens / tpt + p.num_seqs, p.kv_heads * p.chunks, p.splits);
    // Above 48 KiB of dynamic shared memory needs an opt-in, once per device (the first call
    // normally precedes any graph capture).
    static bool opted_in[64] = {};
    int device = 0;
    FT_CUDA_CHECK(cudaGetDevice(&device));
    if (device < 0 || device >= 64 || !opted_in[device]) {
      FT_CUDA_CHECK(cudaFuncSetAttribute(tiled_kernel<T, D, Pool>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         S::kSmemBytes));
      if (device >= 0 && device < 64) opted_in[device] = true;
    }
    tiled_kernel<T, D, Pool><<<grid, kThreads, S::kSmemBytes, stream>>>(p);
    check_launch("paged_attention (tiled)");
    launch_merge<T, D>(p, num_tokens, stream);
  }
#endif
}

template <typename T, int D, typename Pool>
void launch(const AttnParams& p, int num_tokens, bool tiled, cudaStream_t stream) {
  if (tiled) {
    launch_tiled<T, D, Pool>(p, num_tokens, stream);
  } else {
    launch_decode<T, D, Pool>(p, num_tokens, stream);
  }
}

template <typename T, typename Pool>
void launch(const AttnParams& p, int head_dim, int num_tokens, bool tiled, cudaStream_t stream) {
  switch (head_dim) {
    case 64: launch<T, 64, Pool>(p, num_tokens, tiled, stream); break;
    case 128: launch<T, 128, Pool>(p, num_tokens, tiled, stream); break;
    default: launch<T, 256, Pool>(p, num_tokens, tiled, stream); break;
  }
}

// Decode splits: enough blocks for ~2 waves, at least kMinSplitKeys keys each, within the
// workspace the caller passed (none: no split).
int choose_splits(const AttnParams& p, int num_tokens, int64_t max_context, int head_dim,
                  int64_t workspace_floats, int device) {
  int64_t blocks = static_cast<int64_t>(p.num_seqs) * p.kv_heads * p.chunks;
  int64_t want = 2 * static_cast<int64_t>(sm_count(device));
  if (blocks <= 0 || blocks >= want) return 1;
  int64_t splits = ceil_div(want, blocks);
  splits = std::min<int64_t>(splits, ceil_div(max_context, kMinSplitKeys));
  splits = std::min<int64_t>(splits, kMaxSplits);
  int64_t per_split = static_cast<int64_t>(num_tokens) * p.q_heads * (head_dim + 2);
  splits = std::min<int64_t>(splits, per_split > 0 ? workspace_floats / per_split : 1);
  return static_cast<int>(splits < 1 ? 1 : splits);
}

// `fp8`: the FP8 pool (uint8 codes; its scales: fp8::check_scales), else q's dtype.
void check_inputs(const TensorView& out, const TensorView& q, const TensorView& k_cache,
                  const TensorView& v_cache, const TensorView& block_tables,
                  const TensorView& seq_lens, const TensorView& qsl, int64_t block_size,
                  bool fp8) {
  int dev = q.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(k_cache, "k_cache", dev);
  check_gpu(v_cache, "v_cache", dev);
  check_gpu(block_tables, "block_tables", dev);
  check_gpu(seq_lens, "seq_lens", dev);
  check_gpu(qsl, "query_start_loc", dev);
  check_same_dtype(out, q, "out", "q");
  if (fp8) {
    TVM_FFI_ICHECK(float_type(q, "q") != FloatType::kF32)
        << "paged_attention_fp8 takes a bfloat16 or float16 q, got float32";
    check_dtype(k_cache, kDLUInt, 8, "k_cache", "uint8 (e4m3 codes)");
    check_dtype(v_cache, kDLUInt, 8, "v_cache", "uint8 (e4m3 codes)");
  } else {
    check_same_dtype(k_cache, q, "k_cache", "q");
    check_same_dtype(v_cache, q, "v_cache", "q");
  }
  check_ndim(q, 3, "q");
  check_ndim(out, 3, "out");
  check_ndim(k_cache, 3, "k_cache");
  check_ndim(v_cache, 3, "v_cache");
  int64_t d = q.size(2);
  TVM_FFI_ICHECK(d == 64 || d == 128 || d == 256) << "head_dim must be 64, 128 or 256, got " << d;
  TVM_FFI_ICHECK(q.stride(2) == 1) << "q's last dim must be contiguous";
  TVM_FFI_ICHECK(out.size(0) == q.size(0) && out.size(1) == q.size(1) && out.size(2) == d &&
                 out.stride(2) == 1)
      << "out must be [T, Hq, D] like q, last dim contiguous";
  check_contiguous(k_cache, "k_cache");
  check_contiguous(v_cache, "v_cache");
  TVM_FFI_ICHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                 k_cache.size(2) == d && v_cache.size(2) == d)
      << "k_cache and v_cache must both be [S, Hk, " << d << "]";
  TVM_FFI_ICHECK(k_cache.size(1) > 0 && q.size(1) % k_cache.size(1) == 0)
      << "q heads (" << q.size(1) << ") must be a multiple of kv heads (" << k_cache.size(1) << ")";
  TVM_FFI_ICHECK(aligned16(k_cache) && aligned16(v_cache))
      << "k_cache and v_cache must be 16-byte aligned";
  TVM_FFI_ICHECK(block_size > 0 && k_cache.size(0) % block_size == 0)
      << "the pool's slot count " << k_cache.size(0) << " must be a multiple of block_size "
      << block_size;
  check_dtype(block_tables, kDLInt, 32, "block_tables", "int32");
  check_dtype(seq_lens, kDLInt, 32, "seq_lens", "int32");
  check_dtype(qsl, kDLInt, 32, "query_start_loc", "int32");
  check_ndim(block_tables, 2, "block_tables");
  TVM_FFI_ICHECK(block_tables.size(1) <= 1 || block_tables.stride(1) == 1)
      << "block_tables rows must be contiguous";
  int64_t b = seq_lens.size(0);
  TVM_FFI_ICHECK(seq_lens.ndim() == 1 && seq_lens.IsContiguous() && block_tables.size(0) == b)
      << "seq_lens must be a contiguous [B] tensor and block_tables [B, max_blocks]";
  TVM_FFI_ICHECK(qsl.ndim() == 1 && qsl.IsContiguous() && qsl.size(0) == b + 1)
      << "query_start_loc must be a contiguous [B+1] tensor";
}

// Both entry points: inputs checked, the pool's pointers in `p` (k_scale and v_scale null for a
// pool of q's dtype).
void run(AttnParams p, TensorView out, TensorView q, TensorView k_cache,
         TensorView block_tables, TensorView seq_lens, TensorView query_start_loc,
         int64_t block_size, double scale, int64_t sliding_window,
         const tvm::ffi::Optional<TensorView>& workspace) {
  TVM_FFI_ICHECK(sliding_window >= 0) << "sliding_window must be >= 0, got " << sliding_window;
  int dev = q.device().device_id;
  int64_t ws_floats = 0;
  float* ws = nullptr;
  if (workspace.has_value()) {
    const TensorView& w = workspace.value();
    check_gpu(w, "workspace", dev);
    check_dtype(w, kDLFloat, 32, "workspace", "float32");
    check_contiguous(w, "workspace");
    ws_floats = w.numel();
    ws = data_of<float>(w);
  }
  int num_tokens = static_cast<int>(q.size(0));
  int num_seqs = static_cast<int>(seq_lens.size(0));
  if (num_tokens == 0 || num_seqs == 0) return;
  FloatType ft = float_type(q, "q");
  int d = static_cast<int>(q.size(2));
  p.q = data_of<void>(q);
  p.out = data_of<void>(out);
  p.block_tables = data_of<int>(block_tables);
  p.seq_lens = data_of<int>(seq_lens);
  p.query_start_loc = data_of<int>(query_start_loc);
  p.q_stride_t = q.stride(0);
  p.q_stride_h = q.stride(1);
  p.o_stride_t = out.stride(0);
  p.o_stride_h = out.stride(1);
  p.bt_stride = block_tables.stride(0);
  p.num_seqs = num_seqs;
  p.q_heads = static_cast<int>(q.size(1));
  p.kv_heads = static_cast<int>(k_cache.size(1));
  p.group = p.q_heads / p.kv_heads;
  p.block_size = static_cast<int>(block_size);
  p.window = static_cast<int>(sliding_window);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  // The tensor-core kernel (bf16/fp16) needs 16-byte aligned q rows and 4-byte output pairs.
  bool tiled = kHasTensorCorePath && ft != FloatType::kF32 && aligned16(q) && p.q_stride_t % 8 == 0 &&
               p.q_stride_h % 8 == 0 && p.o_stride_t % 2 == 0 && p.o_stride_h % 2 == 0 &&
               reinterpret_cast<uintptr_t>(p.out) % 4 == 0;
  p.chunks = static_cast<int>(ceil_div(p.group, tiled ? kTileMaxGroup : kDecodeMaxGroup));
  p.head_chunk = static_cast<int>(ceil_div(p.group, p.chunks));
  p.splits = 1;
  if (num_tokens == num_seqs) {  // a decode batch: split long KV ranges over more blocks
    int64_t max_context = block_tables.size(1) * block_size;
    if (sliding_window > 0) max_context = std::min<int64_t>(max_context, sliding_window);
    p.splits = choose_splits(p, num_tokens, max_context, d, ws_floats, dev);
  }
  if (p.splits > 1) {
    p.part_o = ws;
    p.part_ml = ws + static_cast<int64_t>(num_tokens) * p.q_heads * p.splits * d;
  }
  bool fp8 = p.k_scale != nullptr;
  DeviceGuard guard(dev);
  cudaStream_t stream = stream_for(q);
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    if constexpr (std::is_same_v<T, float>) {  // check_inputs refuses float32 over FP8
      launch<T, PlainPool<T>>(p, d, num_tokens, tiled, stream);
    } else if (fp8) {
      launch<T, Fp8Pool>(p, d, num_tokens, tiled, stream);
    } else {
      launch<T, PlainPool<T>>(p, d, num_tokens, tiled, stream);
    }
  });
}

/*!
 * \brief Causal attention of new tokens over the paged pool; see ops.paged_attention.
 * \param workspace optional float32 scratch for split decode: splits S use T*Hq*S*(D+2) floats;
 *        a smaller (or no) workspace only limits S. 1M floats covers every decode batch with
 *        Hq/Hk <= 8 and D <= 256 on GPUs of up to 240 SMs.
 */
void paged_attention(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                     TensorView block_tables, TensorView seq_lens, TensorView query_start_loc,
                     int64_t block_size, double scale, int64_t sliding_window,
                     tvm::ffi::Optional<TensorView> workspace) {
  check_inputs(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size,
               false);
  AttnParams p{};
  p.k_cache = data_of<void>(k_cache);
  p.v_cache = data_of<void>(v_cache);
  run(p, out, q, k_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
      sliding_window, workspace);
}

/*!
 * \brief paged_attention over the FP8 pool: k_cache, v_cache uint8 [S, Hk, D] e4m3 codes,
 * k_scale, v_scale float32 [S, Hk] (store_kv_fp8); q and out bfloat16 or float16.
 */
void paged_attention_fp8(TensorView out, TensorView q, TensorView k_cache, TensorView v_cache,
                         TensorView k_scale, TensorView v_scale, TensorView block_tables,
                         TensorView seq_lens, TensorView query_start_loc, int64_t block_size,
                         double scale, int64_t sliding_window,
                         tvm::ffi::Optional<TensorView> workspace) {
  check_inputs(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, block_size,
               true);
  fp8::check_scales(k_scale, k_cache, "k_scale");
  fp8::check_scales(v_scale, v_cache, "v_scale");
  AttnParams p{};
  p.k_cache = data_of<void>(k_cache);
  p.v_cache = data_of<void>(v_cache);
  p.k_scale = data_of<float>(k_scale);
  p.v_scale = data_of<float>(v_scale);
  run(p, out, q, k_cache, block_tables, seq_lens, query_start_loc, block_size, scale,
      sliding_window, workspace);
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(paged_attention_with_workspace, freetoken::paged_attention);

// `paged_attention` takes the workspace as an optional last argument: a 10-argument call (the
// signature before the workspace existed) runs without one.
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_paged_attention(void* self, const TVMFFIAny* args,
                                                           int32_t num_args, TVMFFIAny* result) {
  if (num_args != 10) {
    return __tvm_ffi_paged_attention_with_workspace(self, args, num_args, result);
  }
  TVMFFIAny padded[11] = {};  // a zeroed TVMFFIAny is None
  std::memcpy(padded, args, sizeof(TVMFFIAny) * 10);
  return __tvm_ffi_paged_attention_with_workspace(self, padded, 11, result);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(paged_attention_fp8_with_workspace, freetoken::paged_attention_fp8);

// `paged_attention_fp8` likewise: 12 arguments run without a workspace.
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_paged_attention_fp8(void* self,
                                                               const TVMFFIAny* args,
                                                               int32_t num_args,
                                                               TVMFFIAny* result) {
  if (num_args != 12) {
    return __tvm_ffi_paged_attention_fp8_with_workspace(self, args, num_args, result);
  }
  TVMFFIAny padded[13] = {};  // a zeroed TVMFFIAny is None
  std::memcpy(padded, args, sizeof(TVMFFIAny) * 12);
  return __tvm_ffi_paged_attention_fp8_with_workspace(self, padded, 13, result);
}
