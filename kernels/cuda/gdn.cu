// Gated DeltaNet on the GPU: the short causal convolution (with its rolling conv state) and the
// gated delta-rule recurrence over per-sequence state slots. Same contract as cpu/gdn.cc; no
// allocation and no host sync, so both run inside the decode CUDA graphs. A slot outside
// [0, S) (graph padding) is skipped rather than raised, which would need a sync.
//
// The recurrence runs token by token: a block owns one (sequence, value head, 16 value columns)
// and keeps that slice of the f32 state in registers for the whole chunk; a lane holds a quarter
// of one column's rows, so the k^T S and q^T S products are its own sums plus two shuffles.
// A step with long prefill chunks runs the chunked form instead (gdn_chunked.cuh; the rule is
// at use_chunked below); decode steps always run this sequential one.
#include "freetoken/cuda_common.cuh"
#include "freetoken/gdn_chunked.cuh"
#include "freetoken/gdn_math.h"

namespace freetoken {
namespace {

constexpr int kConvThreads = 128;
// Recurrence: a warp owns 8 value columns; lane l holds column l % 8 of the rows
// l / 8, l / 8 + 4, ... (4 row groups), so a warp's state loads are whole 32-byte sectors
// and a column's sum over rows is a lane's own partial sum plus two shuffles.
constexpr int kColsPerWarp = 8;
constexpr int kRowGroups = kWarp / kColsPerWarp;
constexpr int kWarpsPerBlock = 2;
constexpr int kColsPerBlock = kColsPerWarp * kWarpsPerBlock;

// The sum of v over the lanes holding the same column (lanes kColsPerWarp apart).
__device__ __forceinline__ float row_group_sum(float v) {
#pragma unroll
  for (int off = kColsPerWarp; off < kWarp; off <<= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

struct SeqArgs {
  const int64_t* positions;
  const int32_t* query_start_loc;
  const int32_t* state_slots;
  int64_t num_slots;
};

__device__ __forceinline__ bool seq_range(const SeqArgs& s, int b, int64_t& begin, int64_t& end,
                                          int64_t& slot, bool& fresh) {
  begin = s.query_start_loc[b];
  end = s.query_start_loc[b + 1];
  slot = s.state_slots[b];
  if (end <= begin || slot < 0 || slot >= s.num_slots) return false;
  fresh = s.positions[begin] == 0;
  return true;
}

template <typename T>
__global__ void conv1d_kernel(T* __restrict__ out, const T* __restrict__ x, int64_t x_stride,
                              T* __restrict__ state, const T* __restrict__ weight, int64_t width,
                              int k, SeqArgs sa) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t begin, end, slot;
  bool fresh;
  if (c >= width || !seq_range(sa, blockIdx.y, begin, end, slot, fresh)) return;
  const int hist = k - 1;
  float window[gdn::kMaxConvKernel];
  float w[gdn::kMaxConvKernel];
  T* st = state + (slot * width + c) * hist;
  for (int j = 0; j < hist; ++j) window[j] = fresh ? 0.f : to_float(st[j]);
  for (int j = 0; j < k; ++j) w[j] = to_float(weight[c * k + j]);
  for (int64_t t = begin; t < end; ++t) {
    window[hist] = to_float(x[t * x_stride + c]);
    float acc = 0.f;
    for (int j = 0; j < k; ++j) acc += w[j] * window[j];
    out[t * width + c] = from_float<T>(gdn::silu(acc));
    for (int j = 0; j < hist; ++j) window[j] = window[j + 1];
  }
  for (int j = 0; j < hist; ++j) st[j] = from_float<T>(window[j]);
}

struct RecurArgs {
  int64_t hk, hv, dk, dv, qkv_stride, ba_stride;
  const float* a_log;
  const float* dt_bias;
  float* state;
};

template <typename T, int RPT>
__global__ void __launch_bounds__(kWarp* kWarpsPerBlock)
    recurrence_kernel(T* __restrict__ out, const T* __restrict__ qkv, const T* __restrict__ ba,
                      RecurArgs p, SeqArgs sa) {
  constexpr int DK = RPT * kRowGroups;
  __shared__ float s_q[DK], s_k[DK], s_gate[2];
  const int h = blockIdx.y, lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int rg = lane / kColsPerWarp;  // this lane's rows: rg, rg + kRowGroups, ...
  int64_t begin, end, slot;
  bool fresh;
  if (!seq_range(sa, blockIdx.z, begin, end, slot, fresh)) return;  // uniform over the block
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColsPerBlock +
                      warp * kColsPerWarp + lane % kColsPerWarp;
  const bool active = col < p.dv;  // per lane: every lane still joins the shuffles
  const int64_t kh = h / (p.hv / p.hk);
  float* st = p.state + (slot * p.hv + h) * DK * p.dv + col;
  float s[RPT];
#pragma unroll
  for (int j = 0; j < RPT; ++j) {
    s[j] = active && !fresh ? st[(rg + j * kRowGroups) * p.dv] : 0.f;
  }
  const float scale = rsqrtf(static_cast<float>(DK));
  for (int64_t t = begin; t < end; ++t) {
    const T* row = qkv + t * p.qkv_stride;
    const float v = active ? to_float(row[2 * p.hk * DK + h * p.dv + col]) : 0.f;
    __syncthreads();  // the previous token is done with the shared vectors
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
      s_q[i] = to_float(row[kh * DK + i]);
      s_k[i] = to_float(row[(p.hk + kh) * DK + i]);
    }
    if (threadIdx.x == 0) {
      const T* g = ba + t * p.ba_stride;
      s_gate[0] = gdn::sigmoid(to_float(g[h]));
      s_gate[1] = gdn::decay(to_float(g[p.hv + h]), p.a_log[h], p.dt_bias[h]);
    }
    __syncthreads();
    float qq = 0.f, kk = 0.f;
#pragma unroll
    for (int i = lane; i < DK; i += kWarp) {
      qq += s_q[i] * s_q[i];
      kk += s_k[i] * s_k[i];
    }
    const float qn = scale * rsqrtf(warp_sum(qq) + gdn::kL2Eps);
    const float kn = rsqrtf(warp_sum(kk) + gdn::kL2Eps);
    const float beta = s_gate[0], decay = s_gate[1];
    // k^T S over this lane's rows, then over the row groups (lanes kColsPerWarp apart)
    float mem = 0.f;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      s[j] *= decay;
      mem += s_k[rg + j * kRowGroups] * kn * s[j];
    }
    mem = row_group_sum(mem);
    const float delta = (v - mem) * beta;
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < RPT; ++j) {
      const int r = rg + j * kRowGroups;
      s[j] += s_k[r] * kn * delta;
      acc += s_q[r] * qn * s[j];
    }
    acc = row_group_sum(acc);
    if (active && rg == 0) out[t * p.hv * p.dv + h * p.dv + col] = from_float<T>(acc);
  }
  if (!active) return;
#pragma unroll
  for (int j = 0; j < RPT; ++j) st[(rg + j * kRowGroups) * p.dv] = s[j];
}

SeqArgs seq_args(const TensorView& positions, const TensorView& query_start_loc,
                 const TensorView& state_slots, int64_t num_tokens, int64_t num_slots, int dev) {
  check_gpu(positions, "positions", dev);
  check_gpu(query_start_loc, "query_start_loc", dev);
  check_gpu(state_slots, "state_slots", dev);
  check_contiguous(positions, "positions");
  check_contiguous(query_start_loc, "query_start_loc");
  check_contiguous(state_slots, "state_slots");
  check_dtype(positions, kDLInt, 64, "positions", "int64");
  check_dtype(query_start_loc, kDLInt, 32, "query_start_loc", "int32");
  check_dtype(state_slots, kDLInt, 32, "state_slots", "int32");
  TVM_FFI_ICHECK(query_start_loc.size(0) == state_slots.size(0) + 1)
      << "query_start_loc must be [B+1] with B = " << state_slots.size(0);
  TVM_FFI_ICHECK(positions.size(0) == num_tokens) << "positions must be [" << num_tokens << "]";
  return {data_of<const int64_t>(positions), data_of<const int32_t>(query_start_loc),
          data_of<const int32_t>(state_slots), num_slots};
}

/*! \brief See cpu/gdn.cc: silu(causal depthwise conv) with the rolling conv state per slot. */
void gdn_conv1d(TensorView out, TensorView x, TensorView conv_state, TensorView weight,
                TensorView positions, TensorView query_start_loc, TensorView state_slots) {
  const int dev = x.device().device_id;
  check_gpu(out, "out", dev);
  check_gpu(x, "x", dev);
  check_gpu(conv_state, "conv_state", dev);
  check_gpu(weight, "weight", dev);
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_dtype(conv_state, x, "conv_state", "x");
  check_same_dtype(weight, x, "weight", "x");
  check_contiguous(out, "out");
  check_contiguous(conv_state, "conv_state");
  check_contiguous(weight, "weight");
  RowView xr = row_view(x, 1, "x");
  check_ndim(weight, 2, "weight");
  check_ndim(conv_state, 3, "conv_state");
  const int k = static_cast<int>(weight.size(1));
  TVM_FFI_ICHECK(weight.size(0) == xr.width && k >= 2 && k <= gdn::kMaxConvKernel)
      << "weight must be [" << xr.width << ", K] with 2 <= K <= " << gdn::kMaxConvKernel;
  TVM_FFI_ICHECK(conv_state.size(1) == xr.width && conv_state.size(2) == k - 1)
      << "conv_state must be [S, " << xr.width << ", " << k - 1 << "]";
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == xr.rows && out.size(1) == xr.width)
      << "out must be [" << xr.rows << ", " << xr.width << "]";
  SeqArgs sa = seq_args(positions, query_start_loc, state_slots, xr.rows, conv_state.size(0), dev);
  const int64_t b = state_slots.size(0);
  if (b == 0 || xr.rows == 0) return;
  DeviceGuard guard(dev);
  dim3 grid(static_cast<unsigned>(ceil_div(xr.width, kConvThreads)), static_cast<unsigned>(b));
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    conv1d_kernel<T><<<grid, kConvThreads, 0, stream_for(x)>>>(
        data_of<T>(out), data_of<const T>(x), xr.stride, data_of<T>(conv_state),
        data_of<const T>(weight), xr.width, k, sa);
  });
  check_launch("gdn_conv1d");
}

template <typename T>
void launch_recurrence(int64_t dk, dim3 grid, cudaStream_t stream, T* out, const T* qkv,
                       const T* ba, const RecurArgs& p, const SeqArgs& sa) {
  const int threads = kWarp * kWarpsPerBlock;
  if (dk == 64) {
    recurrence_kernel<T, 64 / kRowGroups><<<grid, threads, 0, stream>>>(out, qkv, ba, p, sa);
  } else if (dk == 128) {
    recurrence_kernel<T, 128 / kRowGroups><<<grid, threads, 0, stream>>>(out, qkv, ba, p, sa);
  } else {
    recurrence_kernel<T, 256 / kRowGroups><<<grid, threads, 0, stream>>>(out, qkv, ba, p, sa);
  }
}

// The chunked kernel runs when the step has at least kChunkMinTokens tokens more than sequences
// (so some sequence brings a prefill chunk of about that length or more; a decode-only step has
// T == B), in chunks of 64 tokens, or 32 where the device's shared memory per block cannot hold
// 64 (HIP: 64 KiB); with neither, the sequential kernel runs.
constexpr int64_t kChunkMinTokens = 64;

int chunk_size_for(int64_t dk, int dev) {
#if defined(__HIP_PLATFORM_AMD__)
  const size_t limit = 64 << 10;
  (void)dev;
#else
  static int limits[64] = {};
  int limit_i = 0;
  if (dev >= 0 && dev < 64 && limits[dev]) {
    limit_i = limits[dev];
  } else {
    FT_CUDA_CHECK(cudaDeviceGetAttribute(&limit_i, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (dev >= 0 && dev < 64) limits[dev] = limit_i;
  }
  const size_t limit = static_cast<size_t>(limit_i);
#endif
  if (gdn::chunk_smem_bytes(64, dk) <= limit) return 64;
  return gdn::chunk_smem_bytes(32, dk) <= limit ? 32 : 0;
}

template <typename T, int C>
void launch_chunked_c(dim3 grid, cudaStream_t stream, T* out, const T* qkv, const T* ba,
                      const gdn::ChunkArgs& a) {
  const size_t smem = gdn::chunk_smem_bytes(C, a.dk);
#if !defined(__HIP_PLATFORM_AMD__)
  // above 48 KiB needs the opt-in; prefill only (never inside a graph capture)
  FT_CUDA_CHECK(cudaFuncSetAttribute(gdn::chunked_kernel<T, C>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(smem)));
#endif
  gdn::chunked_kernel<T, C><<<grid, gdn::kChunkThreads, smem, stream>>>(out, qkv, ba, a);
}

template <typename T>
void launch_chunked(int chunk, int64_t batch, cudaStream_t stream, T* out, const T* qkv,
                    const T* ba, const RecurArgs& p, const SeqArgs& sa) {
  gdn::ChunkArgs a{p.hk, p.hv, p.dk, p.dv, p.qkv_stride, p.ba_stride, sa.num_slots,
                   p.a_log, p.dt_bias, p.state, sa.positions, sa.query_start_loc,
                   sa.state_slots};
  dim3 grid(static_cast<unsigned>(ceil_div(p.dv, gdn::kChunkCols)), static_cast<unsigned>(p.hv),
            static_cast<unsigned>(batch));
  if (chunk == 64) {
    launch_chunked_c<T, 64>(grid, stream, out, qkv, ba, a);
  } else {
    launch_chunked_c<T, 32>(grid, stream, out, qkv, ba, a);
  }
}

/*! \brief See cpu/gdn.cc: the gated delta rule; here dk in {64, 128, 256}, dv % 4 == 0. */
void gdn_recurrence(TensorView out, TensorView qkv, TensorView ba, TensorView a_log,
                    TensorView dt_bias, TensorView ssm_state, TensorView positions,
                    TensorView query_start_loc, TensorView state_slots) {
  const int dev = qkv.device().device_id;
  for (auto [t, name] : {std::pair{&out, "out"}, {&qkv, "qkv"}, {&ba, "ba"}, {&a_log, "a_log"},
                         {&dt_bias, "dt_bias"}, {&ssm_state, "ssm_state"}}) {
    check_gpu(*t, name, dev);
  }
  FloatType ft = float_type(qkv, "qkv");
  check_same_dtype(out, qkv, "out", "qkv");
  check_same_dtype(ba, qkv, "ba", "qkv");
  check_contiguous(out, "out");
  check_contiguous(ssm_state, "ssm_state");
  check_contiguous(a_log, "a_log");
  check_contiguous(dt_bias, "dt_bias");
  check_dtype(ssm_state, kDLFloat, 32, "ssm_state", "float32");
  check_dtype(a_log, kDLFloat, 32, "a_log", "float32");
  check_dtype(dt_bias, kDLFloat, 32, "dt_bias", "float32");
  check_ndim(ssm_state, 4, "ssm_state");
  RecurArgs p{};
  p.hv = ssm_state.size(1), p.dk = ssm_state.size(2), p.dv = ssm_state.size(3);
  TVM_FFI_ICHECK(p.dk == 64 || p.dk == 128 || p.dk == 256)
      << "the key head dim must be 64, 128 or 256 on the GPU, got " << p.dk;
  TVM_FFI_ICHECK(p.dv % 4 == 0) << "the value head dim must be a multiple of 4";
  RowView qr = row_view(qkv, 1, "qkv"), br = row_view(ba, 1, "ba");
  const int64_t key_cols = qr.width - p.hv * p.dv;
  TVM_FFI_ICHECK(key_cols > 0 && key_cols % (2 * p.dk) == 0)
      << "qkv must be [T, 2*Hk*" << p.dk << " + " << p.hv * p.dv << "]";
  p.hk = key_cols / (2 * p.dk);
  TVM_FFI_ICHECK(p.hv % p.hk == 0) << "value heads must be a multiple of key heads";
  TVM_FFI_ICHECK(br.width == 2 * p.hv && br.rows == qr.rows) << "ba must be [T, " << 2 * p.hv << "]";
  TVM_FFI_ICHECK(a_log.size(0) == p.hv && dt_bias.size(0) == p.hv)
      << "a_log and dt_bias must be [" << p.hv << "]";
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == qr.rows && out.size(1) == p.hv * p.dv)
      << "out must be [" << qr.rows << ", " << p.hv * p.dv << "]";
  SeqArgs sa = seq_args(positions, query_start_loc, state_slots, qr.rows, ssm_state.size(0), dev);
  const int64_t b = state_slots.size(0);
  if (b == 0 || qr.rows == 0) return;
  p.qkv_stride = qr.stride, p.ba_stride = br.stride;
  p.a_log = data_of<const float>(a_log), p.dt_bias = data_of<const float>(dt_bias);
  p.state = data_of<float>(ssm_state);
  DeviceGuard guard(dev);
  const int chunk = qr.rows - b >= kChunkMinTokens ? chunk_size_for(p.dk, dev) : 0;
  if (chunk) {
    FT_CUDA_DISPATCH_FLOAT(ft, T, {
      launch_chunked<T>(chunk, b, stream_for(qkv), data_of<T>(out), data_of<const T>(qkv),
                        data_of<const T>(ba), p, sa);
    });
    check_launch("gdn_recurrence (chunked)");
    return;
  }
  dim3 grid(static_cast<unsigned>(ceil_div(p.dv, kColsPerBlock)), static_cast<unsigned>(p.hv),
            static_cast<unsigned>(b));
  FT_CUDA_DISPATCH_FLOAT(ft, T, {
    launch_recurrence<T>(p.dk, grid, stream_for(qkv), data_of<T>(out), data_of<const T>(qkv),
                         data_of<const T>(ba), p, sa);
  });
  check_launch("gdn_recurrence");
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gdn_conv1d, freetoken::gdn_conv1d);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gdn_recurrence, freetoken::gdn_recurrence);
