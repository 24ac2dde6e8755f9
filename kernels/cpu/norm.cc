// RMSNorm on the CPU, plain and fused with the residual add; f32/bf16/f16 with f32 accumulation.
#include <cmath>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

template <typename T>
float sum_squares(const T* x, int64_t n) {
  float lanes[8] = {};  // independent partial sums: vectorizes without reassociating floats
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      float v = to_float(x[i + l]);
      lanes[l] += v * v;
    }
  }
  float s = 0.f;
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  for (float v : lanes) s += v;
  return s;
}

template <typename T>
void norm_row(T* out, const T* x, const T* weight, int64_t d, float eps) {
  float inv = 1.f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = from_float<T>(to_float(x[i]) * inv * to_float(weight[i]));
}

void check_weight(const TensorView& weight, const TensorView& x, int64_t d) {
  check_contiguous(weight, "weight");
  check_same_dtype(weight, x, "weight", "x");
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) == d)
      << "weight must be [" << d << "] (the last dim of x)";
}

void check_same_shape(const TensorView& a, const TensorView& b, const char* na, const char* nb) {
  bool same = a.ndim() == b.ndim();
  for (int i = 0; same && i < a.ndim(); ++i) same = a.size(i) == b.size(i);
  TVM_FFI_ICHECK(same) << na << " and " << nb << " must have the same shape";
}

void rms_norm(TensorView out, TensorView x, TensorView weight, double eps) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_shape(out, x, "out", "x");
  RowView xr = row_view(x, 1, "x"), orow = row_view(out, 1, "out");
  check_weight(weight, x, xr.width);
  FT_DISPATCH_FLOAT(ft, T, {
    const T* xp = data_of<T>(x);
    const T* wp = data_of<T>(weight);
    T* op = data_of<T>(out);
    for (int64_t r = 0; r < xr.rows; ++r) {
      norm_row(op + orow.offset(r), xp + xr.offset(r), wp, xr.width, static_cast<float>(eps));
    }
  });
}

void fused_add_rms_norm(TensorView x, TensorView residual, TensorView weight, double eps) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(residual, x, "residual", "x");
  check_same_shape(residual, x, "residual", "x");
  RowView xr = row_view(x, 1, "x"), rr = row_view(residual, 1, "residual");
  check_weight(weight, x, xr.width);
  FT_DISPATCH_FLOAT(ft, T, {
    T* xp = data_of<T>(x);
    T* rp = data_of<T>(residual);
    const T* wp = data_of<T>(weight);
    for (int64_t r = 0; r < xr.rows; ++r) {
      T* xrow = xp + xr.offset(r);
      T* rrow = rp + rr.offset(r);
      // The sum is rounded to the residual's dtype first; the norm reads the rounded value.
      for (int64_t i = 0; i < xr.width; ++i) {
        rrow[i] = from_float<T>(to_float(rrow[i]) + to_float(xrow[i]));
      }
      norm_row(xrow, rrow, wp, xr.width, static_cast<float>(eps));
    }
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rms_norm, freetoken::rms_norm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rms_norm, freetoken::fused_add_rms_norm);
