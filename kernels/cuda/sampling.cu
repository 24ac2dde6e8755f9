// Token sampling on the GPU, one block per row: greedy, or temperature + top-k + top-p.
//
// Exact selection without sorting: each logit gets an ordered key, its temperature-scaled
// distance below the row max in units of 2^-27 nats (ties closer than that count as ties), and
// a radix select over the key's four bytes finds the top-k and top-p thresholds. Probabilities
// are fixed-point integers (2^40 = the max token's weight), so every sum is exact and the
// result is bit-reproducible for a given (seed, offset, row). Tokens more than 32 nats below the
// max weigh zero and are never sampled. No host sync, no allocation: graph-capturable.
#include "freetoken/cuda_common.cuh"

namespace freetoken {
namespace {

constexpr int kThreads = 1024;
constexpr int kBins = 256;
constexpr float kKeyScale = 134217728.f;     // 2^27 key units per nat
constexpr float kFixedOne = 1099511627776.f; // 2^40: the fixed-point weight of the row max
constexpr uint32_t kTail = 0xffffffffu;      // key of NaN / -inf / >= 32 nats below the max

using u64 = unsigned long long;

struct RowCtx {
  const float* logits;
  int vocab;
  bool vec4;  // 16-byte aligned row: read it as float4
  float max_logit;
  float inv_temp;
};

// Calls f(index, logit) for this thread's share of the row (ascending indices per thread).
template <typename F>
__device__ __forceinline__ void for_each_logit(const RowCtx& rc, F&& f) {
  int start = 0;
  if (rc.vec4) {
    const float4* row4 = reinterpret_cast<const float4*>(rc.logits);
    int n4 = rc.vocab / 4;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
      float4 v = row4[i];
      f(4 * i, v.x);
      f(4 * i + 1, v.y);
      f(4 * i + 2, v.z);
      f(4 * i + 3, v.w);
    }
    start = n4 * 4;
  }
  for (int i = start + threadIdx.x; i < rc.vocab; i += blockDim.x) f(i, rc.logits[i]);
}

// Both helpers round every step explicitly (no FMA contraction), so a logit gets the same key
// and weight in every pass.
__device__ __forceinline__ float scaled_distance(float x, const RowCtx& r) {
  return __fmul_rn(__fsub_rn(r.max_logit, x), r.inv_temp);
}

__device__ __forceinline__ uint32_t key_of(float x, const RowCtx& r) {
  float d = scaled_distance(x, r);
  return d < 32.f ? __float2uint_rz(__fmul_rn(d, kKeyScale)) : kTail;
}

__device__ __forceinline__ u64 weight_of(float x, const RowCtx& r) {
  float d = scaled_distance(x, r);
  return d < 32.f ? __float2ull_rz(__fmul_rn(__expf(-d), kFixedOne)) : 0ull;
}

struct Shared {
  uint32_t count[kBins];
  u64 mass[kBins];
  u64 warp_total[kWarp];
  // Results broadcast by warp 0 (or the finder thread).
  int digit;
  u64 before, target, total;
  uint32_t bin_count;
  int64_t found;
  float best_val;
  int best_idx;
};

__device__ __forceinline__ u64 warp_inclusive_scan(u64 v) {
  int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    u64 o = __shfl_up_sync(0xffffffffu, v, off);
    if (lane >= off) v += o;
  }
  return v;
}

// Warp 0: the first bin (ascending key = descending probability) at which `above` plus the
// cumulative weight reaches the target. top_p >= 0 means the target is top_p of the total.
__device__ void scan_bins(Shared& sh, bool by_mass, int nbins, u64 above, u64 target,
                          float top_p) {
  int lane = threadIdx.x;
  u64 w[8], local = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    int bin = lane * 8 + j;
    w[j] = bin < nbins ? (by_mass ? sh.mass[bin] : static_cast<u64>(sh.count[bin])) : 0ull;
    local += w[j];
  }
  u64 incl = warp_inclusive_scan(local);
  u64 total = __shfl_sync(0xffffffffu, incl, kWarp - 1);
  if (top_p >= 0.f) {  // smallest mass reaching top_p of the total, at least one unit
    double t = ceil(static_cast<double>(top_p) * static_cast<double>(total));
    target = t < 1.0 ? 1ull : (t > static_cast<double>(total) ? total : static_cast<u64>(t));
  }
  unsigned hit = __ballot_sync(0xffffffffu, above + incl >= target);
  if (lane == 0) {
    sh.digit = -1;
    sh.target = target;
  }
  if (hit == 0) return;
  int first = __ffs(hit) - 1;
  if (lane == first) {
    u64 cum = above + incl - local;
    for (int j = 0; j < 8; ++j) {
      if (cum + w[j] >= target) {
        sh.digit = lane * 8 + j;
        sh.before = cum;
        sh.bin_count = sh.count[lane * 8 + j];
        break;
      }
      cum += w[j];
    }
  }
}

/*!
 * The smallest key threshold θ such that the tokens with key <= θ (and <= limit) reach the
 * target: a count (top-k) or top_p of their total probability (top-p). kTail means no cut.
 */
__device__ uint32_t select_threshold(const RowCtx& rc, Shared& sh, bool by_mass, uint32_t limit,
                                     u64 count_target, float top_p) {
  uint32_t prefix = 0;
  u64 above = 0, target = count_target;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
      sh.count[i] = 0;
      sh.mass[i] = 0;
    }
    __syncthreads();
    for_each_logit(rc, [&](int, float x) {
      uint32_t key = key_of(x, rc);
      if (key > limit) return;
      if (shift < 24 && (key >> (shift + 8)) != (prefix >> (shift + 8))) return;
      uint32_t digit = (key >> shift) & 255u;
      if (shift == 24 && digit == 255u) return;  // >= 31.875 nats below the max: weight 0
      atomicAdd(&sh.count[digit], 1u);
      if (by_mass) atomicAdd(&sh.mass[digit], weight_of(x, rc));
    });
    __syncthreads();
    if (threadIdx.x < kWarp) {
      bool first_mass_pass = by_mass && shift == 24;
      scan_bins(sh, by_mass, shift == 24 ? kBins - 1 : kBins, above, target,
                first_mass_pass ? top_p : -1.f);
    }
    __syncthreads();
    int digit = sh.digit;
    target = sh.target;
    if (digit < 0) return shift == 24 ? kTail : (prefix | ((1u << (shift + 8)) - 1u));
    prefix |= static_cast<uint32_t>(digit) << shift;
    above = sh.before;
    // One token in the bin, or the whole bin is exactly the top-k: no need to refine.
    bool settled = sh.bin_count == 1 || (!by_mass && above + sh.bin_count == target);
    if (settled || shift == 0) return shift == 0 ? prefix : (prefix | ((1u << shift) - 1u));
  }
  return prefix;
}

// Row max and its first index (greedy result); NaN logits are ignored.
__device__ void row_argmax(const RowCtx& rc, Shared& sh) {
  float best = -__builtin_huge_valf();
  int idx = rc.vocab;
  for_each_logit(rc, [&](int i, float x) {
    if (x > best) {
      best = x;
      idx = i;
    }
  });
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    float ob = __shfl_xor_sync(0xffffffffu, best, off);
    int oi = __shfl_xor_sync(0xffffffffu, idx, off);
    if (ob > best || (ob == best && oi < idx)) {
      best = ob;
      idx = oi;
    }
  }
  __shared__ float vals[kWarp];
  __shared__ int idxs[kWarp];
  int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (lane == 0) {
    vals[warp] = best;
    idxs[warp] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int j = 1; j < static_cast<int>(blockDim.x / kWarp); ++j) {
      if (vals[j] > best || (vals[j] == best && idxs[j] < idx)) {
        best = vals[j];
        idx = idxs[j];
      }
    }
    sh.best_val = best;
    sh.best_idx = idx < rc.vocab ? idx : 0;
  }
  __syncthreads();
}

// Block-wide exclusive scan of one u64 per thread; returns the prefix, sets sh.total.
__device__ u64 block_exclusive_scan(u64 v, Shared& sh) {
  int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  u64 incl = warp_inclusive_scan(v);
  if (lane == kWarp - 1) sh.warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int nwarps = blockDim.x / kWarp;
    u64 t = lane < nwarps ? sh.warp_total[lane] : 0ull;
    u64 ti = warp_inclusive_scan(t);
    if (lane < nwarps) sh.warp_total[lane] = ti - t;
    if (lane == kWarp - 1) sh.total = ti;
  }
  __syncthreads();
  return sh.warp_total[warp] + incl - v;
}

// Inverse-CDF draw over the tokens with key <= theta, in vocabulary order; -1 if none weigh.
__device__ int64_t draw(const RowCtx& rc, Shared& sh, uint32_t theta, u64 random) {
  int chunk = (rc.vocab + blockDim.x - 1) / blockDim.x;
  int begin = threadIdx.x * chunk, end = min(rc.vocab, begin + chunk);
  u64 local = 0;
  for (int i = begin; i < end; ++i) {
    float x = rc.logits[i];
    if (key_of(x, rc) <= theta) local += weight_of(x, rc);
  }
  if (threadIdx.x == 0) sh.found = -1;
  u64 before = block_exclusive_scan(local, sh);  // its barriers order the write above
  u64 total = sh.total;
  if (total == 0) return -1;
  u64 target = __umul64hi(random, total);  // uniform in [0, total)
  if (local > 0 && before <= target && target < before + local) {
    u64 cum = before;
    for (int i = begin; i < end; ++i) {
      float x = rc.logits[i];
      if (key_of(x, rc) > theta) continue;
      cum += weight_of(x, rc);
      if (cum > target) {
        sh.found = i;
        break;
      }
    }
  }
  __syncthreads();
  return sh.found;
}

// Philox4x32-10 keyed by the seed; the counter holds the row and the offset.
__device__ u64 philox(uint64_t seed, uint64_t offset, uint32_t row) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  uint32_t c0 = row, c1 = 0x46726565u, c2 = static_cast<uint32_t>(offset),
           c3 = static_cast<uint32_t>(offset >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return (static_cast<u64>(c0) << 32) | c1;
}

__global__ void __launch_bounds__(kThreads)
    sample_kernel(int64_t* __restrict__ out_ids, const float* __restrict__ logits,
                  int64_t row_stride, int vocab, const float* __restrict__ temperature,
                  const int* __restrict__ top_k, const float* __restrict__ top_p, uint64_t seed,
                  uint64_t offset) {
  __shared__ Shared sh;
  const int row = blockIdx.x;
  const float* row_logits = logits + row * row_stride;
  RowCtx rc{row_logits, vocab, reinterpret_cast<uintptr_t>(row_logits) % 16 == 0, 0.f, 1.f};
  row_argmax(rc, sh);
  const float temp = temperature[row];
  const float best = sh.best_val;
  const int greedy = sh.best_idx;
  // Greedy: temperature <= 0 (or NaN), or a row with no finite maximum.
  if (!(temp > 0.f) || !(best > -__builtin_huge_valf() && best < __builtin_huge_valf())) {
    if (threadIdx.x == 0) out_ids[row] = greedy;
    return;
  }
  rc.max_logit = best;
  rc.inv_temp = 1.f / temp;
  const int k = top_k[row];
  const float p = top_p[row];
  uint32_t theta = kTail;
  if (k > 0 && k < vocab) theta = select_threshold(rc, sh, false, kTail, k, -1.f);
  if (p < 1.f) {
    uint32_t theta_p = select_threshold(rc, sh, true, theta, 0, p > 0.f ? p : 0.f);
    theta = theta_p < theta ? theta_p : theta;
  }
  int64_t idx = draw(rc, sh, theta, philox(seed, offset, static_cast<uint32_t>(row)));
  if (threadIdx.x == 0) out_ids[row] = idx >= 0 ? idx : greedy;
}

/*! \brief See the module docstring of ops.sample_tokens for the semantics. */
void sample_tokens(TensorView out_ids, TensorView logits, TensorView temperature,
                   TensorView top_k, TensorView top_p, int64_t seed, int64_t offset) {
  int dev = logits.device().device_id;
  check_gpu(out_ids, "out_ids", dev);
  check_gpu(logits, "logits", dev);
  check_gpu(temperature, "temperature", dev);
  check_gpu(top_k, "top_k", dev);
  check_gpu(top_p, "top_p", dev);
  check_dtype(out_ids, kDLInt, 64, "out_ids", "int64");
  check_dtype(logits, kDLFloat, 32, "logits", "float32");
  check_dtype(temperature, kDLFloat, 32, "temperature", "float32");
  check_dtype(top_k, kDLInt, 32, "top_k", "int32");
  check_dtype(top_p, kDLFloat, 32, "top_p", "float32");
  check_ndim(logits, 2, "logits");
  int64_t rows = logits.size(0), vocab = logits.size(1);
  TVM_FFI_ICHECK(vocab > 0 && vocab < (int64_t{1} << 31) && (vocab == 1 || logits.stride(1) == 1))
      << "logits must be [B, V] with contiguous rows and 0 < V < 2^31";
  for (auto* t : {&out_ids, &temperature, &top_k, &top_p}) {
    TVM_FFI_ICHECK(t->ndim() == 1 && t->size(0) == rows && t->IsContiguous())
        << "out_ids, temperature, top_k and top_p must be contiguous [" << rows << "] tensors";
  }
  if (rows == 0) return;
  TVM_FFI_ICHECK(rows < (int64_t{1} << 31)) << "too many rows: " << rows;
  DeviceGuard guard(dev);
  sample_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream_for(logits)>>>(
      data_of<int64_t>(out_ids), data_of<float>(logits), logits.stride(0),
      static_cast<int>(vocab), data_of<float>(temperature), data_of<int>(top_k),
      data_of<float>(top_p), static_cast<uint64_t>(seed), static_cast<uint64_t>(offset));
  check_launch("sample_tokens");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(sample_tokens, freetoken::sample_tokens);
