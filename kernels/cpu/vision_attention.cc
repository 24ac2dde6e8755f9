// Non-causal attention over variable-length segments (the vision encoder: every patch of an
// image sees every patch of the same image, none of another). f32/bf16/f16 in, math in f32.
// Each (segment, head, query block) is one pool task; scores for one query live in a scratch
// row of the segment's length, so memory stays O(longest segment) per thread.
#include <algorithm>
#include <cmath>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/cpu_thread_pool.h"

namespace freetoken {
namespace {

constexpr int64_t kQueryBlock = 16;

template <typename T>
void attend_block(T* out, int64_t out_stride, const T* q, const T* k, const T* v,
                  int64_t q_stride, int64_t k_stride, int64_t v_stride, int64_t begin,
                  int64_t end, int64_t q_begin, int64_t q_end, int64_t head, int64_t dim,
                  float scale) {
  std::vector<float> scores(end - begin), qf(dim), acc(dim);
  for (int64_t i = q_begin; i < q_end; ++i) {
    const T* qi = q + i * q_stride + head * dim;
    for (int64_t d = 0; d < dim; ++d) qf[d] = to_float(qi[d]) * scale;
    float top = -INFINITY;
    for (int64_t j = begin; j < end; ++j) {
      const T* kj = k + j * k_stride + head * dim;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[d] * to_float(kj[d]);
      scores[j - begin] = s;
      top = std::max(top, s);
    }
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = begin; j < end; ++j) {
      const float p = std::exp(scores[j - begin] - top);
      total += p;
      const T* vj = v + j * v_stride + head * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += p * to_float(vj[d]);
    }
    T* oi = out + i * out_stride + head * dim;
    for (int64_t d = 0; d < dim; ++d) oi[d] = from_float<T>(acc[d] / total);
  }
}

struct Task {
  int64_t begin, end, q_begin, q_end, head;
};

/*!
 * \brief out[t, h*D:(h+1)*D] = softmax(q_t . k_s * scale) v_s over the s of t's segment.
 * q, k, v, out: [T, H*D] (rows may be strided: column slices of a fused qkv); cu_seqlens
 * int32 [S+1] from 0 to T.
 */
void vision_attention(TensorView out, TensorView q, TensorView k, TensorView v,
                      TensorView cu_seqlens, int64_t num_heads, double scale) {
  FloatType ft = float_type(q, "q");
  check_same_dtype(k, q, "k", "q");
  check_same_dtype(v, q, "v", "q");
  check_same_dtype(out, q, "out", "q");
  check_cpu(cu_seqlens, "cu_seqlens");
  check_contiguous(cu_seqlens, "cu_seqlens");
  check_dtype(cu_seqlens, kDLInt, 32, "cu_seqlens", "int32");
  RowView qr = row_view(q, 1, "q"), kr = row_view(k, 1, "k"), vr = row_view(v, 1, "v"),
          orow = row_view(out, 1, "out");
  const int64_t tokens = qr.rows, width = qr.width;
  TVM_FFI_ICHECK(num_heads > 0 && width % num_heads == 0)
      << "q's width " << width << " is not a multiple of num_heads " << num_heads;
  TVM_FFI_ICHECK(kr.rows == tokens && vr.rows == tokens && orow.rows == tokens &&
                 kr.width == width && vr.width == width && orow.width == width)
      << "q, k, v and out must all be [" << tokens << ", " << width << "]";
  TVM_FFI_ICHECK(qr.uniform_stride() > 0 && kr.uniform_stride() > 0 &&
                 vr.uniform_stride() > 0 && orow.uniform_stride() > 0)
      << "q, k, v and out must be 2-D row views";
  const int64_t segments = cu_seqlens.size(0) - 1;
  const int32_t* cu = data_of<const int32_t>(cu_seqlens);
  TVM_FFI_ICHECK(segments >= 0 && cu[0] == 0 && cu[segments] == tokens)
      << "cu_seqlens must run from 0 to " << tokens;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < segments; ++s) {
    TVM_FFI_ICHECK(cu[s + 1] >= cu[s]) << "cu_seqlens must not decrease";
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t i = cu[s]; i < cu[s + 1]; i += kQueryBlock) {
        tasks.push_back({cu[s], cu[s + 1], i, std::min<int64_t>(i + kQueryBlock, cu[s + 1]), h});
      }
    }
  }
  const int64_t dim = width / num_heads;
  const float sc = static_cast<float>(scale);
  FT_DISPATCH_FLOAT(ft, T, {
    T* op = data_of<T>(out);
    const T *qp = data_of<const T>(q), *kp = data_of<const T>(k), *vp = data_of<const T>(v);
    const int64_t os = orow.uniform_stride(), qs = qr.uniform_stride(),
                  ks = kr.uniform_stride(), vs = vr.uniform_stride();
    parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const Task& w = tasks[t];
        attend_block<T>(op, os, qp, kp, vp, qs, ks, vs, w.begin, w.end, w.q_begin, w.q_end,
                        w.head, dim, sc);
      }
    });
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(vision_attention, freetoken::vision_attention);
