// Gated DeltaNet on the CPU: the short causal convolution (with its rolling conv state) and the
// gated delta-rule recurrence (with its per-sequence state), token by token. Both serve prefill
// chunks and decode steps alike: sequence b's tokens are query_start_loc[b]..[b+1], its states
// live in slot state_slots[b], and a sequence whose first new token sits at position 0 starts
// from zero states instead of reading the slot.
#include <cmath>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/gdn_math.h"

namespace freetoken {
namespace {

struct SeqRange {
  int64_t begin, end, slot;
  bool fresh;  // the sequence starts here: zero states
};

std::vector<SeqRange> sequences(const TensorView& positions, const TensorView& query_start_loc,
                                const TensorView& state_slots, int64_t num_tokens,
                                int64_t num_slots) {
  check_contiguous(positions, "positions");
  check_contiguous(query_start_loc, "query_start_loc");
  check_contiguous(state_slots, "state_slots");
  check_dtype(positions, kDLInt, 64, "positions", "int64");
  check_dtype(query_start_loc, kDLInt, 32, "query_start_loc", "int32");
  check_dtype(state_slots, kDLInt, 32, "state_slots", "int32");
  const int64_t b = state_slots.size(0);
  TVM_FFI_ICHECK(query_start_loc.size(0) == b + 1)
      << "query_start_loc must be [B+1] with B = " << b << " (the length of state_slots)";
  TVM_FFI_ICHECK(positions.size(0) == num_tokens) << "positions must be [" << num_tokens << "]";
  const int32_t* qs = data_of<const int32_t>(query_start_loc);
  const int32_t* slots = data_of<const int32_t>(state_slots);
  const int64_t* pos = data_of<const int64_t>(positions);
  std::vector<SeqRange> out;
  for (int64_t i = 0; i < b; ++i) {
    TVM_FFI_ICHECK(qs[i] >= 0 && qs[i] <= qs[i + 1] && qs[i + 1] <= num_tokens)
        << "query_start_loc must rise from 0 to at most " << num_tokens;
    TVM_FFI_ICHECK(slots[i] >= 0 && slots[i] < num_slots)
        << "state_slots[" << i << "] = " << slots[i] << " is outside [0, " << num_slots << ")";
    bool fresh = qs[i] < qs[i + 1] && pos[qs[i]] == 0;
    out.push_back({qs[i], qs[i + 1], slots[i], fresh});
  }
  return out;
}

template <typename T>
void conv_channels(T* out, int64_t out_stride, const T* x, const RowView& xr, T* state,
                   const T* weight, int k, const SeqRange& s, int64_t c0, int64_t c1) {
  const int hist = k - 1;
  const int64_t width = xr.width;
  for (int64_t c = c0; c < c1; ++c) {
    float window[gdn::kMaxConvKernel];
    T* st = state + (s.slot * width + c) * hist;
    for (int j = 0; j < hist; ++j) window[j] = s.fresh ? 0.f : to_float(st[j]);
    float w[gdn::kMaxConvKernel];
    for (int j = 0; j < k; ++j) w[j] = to_float(weight[c * k + j]);
    for (int64_t t = s.begin; t < s.end; ++t) {
      window[hist] = to_float(x[xr.offset(t) + c]);
      float acc = 0.f;
      for (int j = 0; j < k; ++j) acc += w[j] * window[j];
      out[t * out_stride + c] = from_float<T>(gdn::silu(acc));
      for (int j = 0; j < hist; ++j) window[j] = window[j + 1];
    }
    if (s.end > s.begin || s.fresh) {
      for (int j = 0; j < hist; ++j) st[j] = from_float<T>(window[j]);
    }
  }
}

/*!
 * \brief out[t, c] = silu(sum_j weight[c, j] * x[t - (K-1) + j, c]), the inputs before a chunk
 * coming from conv_state[slot] (the last K-1 inputs seen), which is then updated.
 * out [T, C] contiguous; x [T, C] (rows may be strided); conv_state [S, C, K-1]; weight [C, K].
 */
void gdn_conv1d(TensorView out, TensorView x, TensorView conv_state, TensorView weight,
                TensorView positions, TensorView query_start_loc, TensorView state_slots) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_dtype(conv_state, x, "conv_state", "x");
  check_same_dtype(weight, x, "weight", "x");
  check_contiguous(out, "out");
  check_contiguous(conv_state, "conv_state");
  check_contiguous(weight, "weight");
  RowView xr = row_view(x, 1, "x");
  const int64_t c = xr.width;
  check_ndim(weight, 2, "weight");
  const int k = static_cast<int>(weight.size(1));
  TVM_FFI_ICHECK(weight.size(0) == c && k >= 2 && k <= gdn::kMaxConvKernel)
      << "weight must be [" << c << ", K] with 2 <= K <= " << gdn::kMaxConvKernel;
  check_ndim(conv_state, 3, "conv_state");
  TVM_FFI_ICHECK(conv_state.size(1) == c && conv_state.size(2) == k - 1)
      << "conv_state must be [S, " << c << ", " << k - 1 << "]";
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == xr.rows && out.size(1) == c)
      << "out must be [" << xr.rows << ", " << c << "]";
  auto seqs = sequences(positions, query_start_loc, state_slots, xr.rows, conv_state.size(0));
  constexpr int64_t kChannelBlock = 256;
  const int64_t blocks = (c + kChannelBlock - 1) / kChannelBlock;
  FT_DISPATCH_FLOAT(ft, T, {
    T* o = data_of<T>(out);
    const T* xp = data_of<const T>(x);
    T* st = data_of<T>(conv_state);
    const T* w = data_of<const T>(weight);
    parallel_for(static_cast<int64_t>(seqs.size()) * blocks, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t c0 = (i % blocks) * kChannelBlock;
        conv_channels(o, c, xp, xr, st, w, k, seqs[i / blocks], c0,
                      std::min(c, c0 + kChannelBlock));
      }
    });
  });
}

struct RecurrenceDims {
  int64_t hk, hv, dk, dv;
  int64_t k_off, v_off;  // column offsets of k and v within a qkv row
};

// One (sequence, value head): the state [dk, dv] in f32, token by token.
template <typename T>
void recur_head(T* out, const T* qkv, const RowView& qr, const T* ba, const RowView& br,
                float a_log, float dt_bias, float* state, const RecurrenceDims& d,
                const SeqRange& s, int64_t h) {
  const int64_t kh = h / (d.hv / d.hk);
  const float scale = 1.f / std::sqrt(static_cast<float>(d.dk));
  std::vector<float> q(d.dk), k(d.dk), delta(d.dv), acc(d.dv);
  if (s.fresh) std::fill(state, state + d.dk * d.dv, 0.f);
  for (int64_t t = s.begin; t < s.end; ++t) {
    const T* row = qkv + qr.offset(t);
    float qq = 0.f, kk = 0.f;
    for (int64_t i = 0; i < d.dk; ++i) {
      q[i] = to_float(row[kh * d.dk + i]);
      k[i] = to_float(row[d.k_off + kh * d.dk + i]);
      qq += q[i] * q[i];
      kk += k[i] * k[i];
    }
    const float qn = scale / std::sqrt(qq + gdn::kL2Eps), kn = 1.f / std::sqrt(kk + gdn::kL2Eps);
    for (int64_t i = 0; i < d.dk; ++i) q[i] *= qn, k[i] *= kn;
    const T* bar = ba + br.offset(t);
    const float beta = gdn::sigmoid(to_float(bar[h]));
    const float decay = gdn::decay(to_float(bar[d.hv + h]), a_log, dt_bias);
    const T* v = row + d.v_off + h * d.dv;
    for (int64_t j = 0; j < d.dv; ++j) delta[j] = 0.f;
    for (int64_t i = 0; i < d.dk; ++i) {
      float* srow = state + i * d.dv;
      for (int64_t j = 0; j < d.dv; ++j) {
        srow[j] *= decay;
        delta[j] += k[i] * srow[j];
      }
    }
    for (int64_t j = 0; j < d.dv; ++j) delta[j] = (to_float(v[j]) - delta[j]) * beta;
    T* o = out + t * d.hv * d.dv + h * d.dv;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t i = 0; i < d.dk; ++i) {
      float* srow = state + i * d.dv;
      for (int64_t j = 0; j < d.dv; ++j) {
        srow[j] += k[i] * delta[j];
        acc[j] += q[i] * srow[j];
      }
    }
    for (int64_t j = 0; j < d.dv; ++j) o[j] = from_float<T>(acc[j]);
  }
}

/*!
 * \brief The gated delta rule over new tokens, per value head h (key head h / (Hv/Hk)):
 *   q, k L2-normed (q also scaled by dk^-1/2); beta = sigmoid(b); decay = exp(-exp(A_log) *
 *   softplus(a + dt_bias)); S *= decay; S += k (x) beta (v - k^T S); out = q^T S.
 * out [T, Hv*dv]; qkv [T, 2*Hk*dk + Hv*dv] (q, k, v columns; rows may be strided); ba
 * [T, 2*Hv] (b, then a; rows may be strided); a_log, dt_bias f32 [Hv]; ssm_state f32
 * [S, Hv, dk, dv], read (unless the sequence is fresh) and written back.
 */
void gdn_recurrence(TensorView out, TensorView qkv, TensorView ba, TensorView a_log,
                    TensorView dt_bias, TensorView ssm_state, TensorView positions,
                    TensorView query_start_loc, TensorView state_slots) {
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
  RecurrenceDims d{};
  d.hv = ssm_state.size(1), d.dk = ssm_state.size(2), d.dv = ssm_state.size(3);
  RowView qr = row_view(qkv, 1, "qkv"), br = row_view(ba, 1, "ba");
  const int64_t key_cols = qr.width - d.hv * d.dv;
  TVM_FFI_ICHECK(key_cols > 0 && key_cols % (2 * d.dk) == 0)
      << "qkv must be [T, 2*Hk*" << d.dk << " + " << d.hv * d.dv << "]";
  d.hk = key_cols / (2 * d.dk);
  TVM_FFI_ICHECK(d.hv % d.hk == 0) << "value heads (" << d.hv << ") must be a multiple of key "
                                   << "heads (" << d.hk << ")";
  d.k_off = d.hk * d.dk, d.v_off = 2 * d.hk * d.dk;
  TVM_FFI_ICHECK(br.width == 2 * d.hv && br.rows == qr.rows) << "ba must be [T, " << 2 * d.hv << "]";
  TVM_FFI_ICHECK(a_log.size(0) == d.hv && dt_bias.size(0) == d.hv)
      << "a_log and dt_bias must be [" << d.hv << "]";
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == qr.rows && out.size(1) == d.hv * d.dv)
      << "out must be [" << qr.rows << ", " << d.hv * d.dv << "]";
  auto seqs = sequences(positions, query_start_loc, state_slots, qr.rows, ssm_state.size(0));
  const float* al = data_of<const float>(a_log);
  const float* dt = data_of<const float>(dt_bias);
  float* st = data_of<float>(ssm_state);
  const int64_t hv = d.hv;
  FT_DISPATCH_FLOAT(ft, T, {
    T* o = data_of<T>(out);
    const T* q = data_of<const T>(qkv);
    const T* b = data_of<const T>(ba);
    parallel_for(static_cast<int64_t>(seqs.size()) * hv, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const SeqRange& s = seqs[i / hv];
        const int64_t h = i % hv;
        float* state = st + (s.slot * hv + h) * d.dk * d.dv;
        recur_head(o, q, qr, b, br, al[h], dt[h], state, d, s, h);
      }
    });
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(gdn_conv1d, freetoken::gdn_conv1d);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gdn_recurrence, freetoken::gdn_recurrence);
