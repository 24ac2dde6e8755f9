// RMSNorm on the CPU: plain, fused with the residual add, and gated (the Gated DeltaNet output
// norm); f32/bf16/f16 with f32 accumulation.
#include <cmath>

#include "freetoken/cpu_common.h"
#include "freetoken/gdn_math.h"

namespace freetoken {
namespace {

#define FT_ALWAYS_INLINE inline __attribute__((always_inline))

template <typename T>
FT_ALWAYS_INLINE float sum_squares(const T* x, int64_t n) {
  v8f lanes = {};  // independent partial sums: vectorizes without reassociating floats
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8f v;
    if constexpr (std::is_same_v<T, float>) {
      v = load8(x + i);
    } else {
      for (int l = 0; l < 8; ++l) v[l] = to_float(x[i + l]);
    }
    lanes += v * v;
  }
  float s = 0.f;
  for (; i < n; ++i) s += to_float(x[i]) * to_float(x[i]);
  return s + hsum8(lanes);
}

template <typename T>
FT_ALWAYS_INLINE void norm_row(T* out, const T* x, const T* weight, int64_t d, float eps) {
  const float inv = 1.f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= d; i += 8) store8(out + i, load8(x + i) * inv * load8(weight + i));
  }
  for (; i < d; ++i) out[i] = from_float<T>(to_float(x[i]) * inv * to_float(weight[i]));
}

template <typename T>
FT_ALWAYS_INLINE void norm_rows(T* op, const RowView& orow, const T* xp, const RowView& xr,
                                const T* wp, float eps) {
  for (int64_t r = 0; r < xr.rows; ++r) norm_row(op + orow.offset(r), xp + xr.offset(r), wp, xr.width, eps);
}

// The sum is rounded to the residual's dtype first; the norm reads the rounded value.
template <typename T>
FT_ALWAYS_INLINE void add_norm_rows(T* xp, const RowView& xr, T* rp, const RowView& rr,
                                    const T* wp, float eps) {
  for (int64_t r = 0; r < xr.rows; ++r) {
    T* xrow = xp + xr.offset(r);
    T* rrow = rp + rr.offset(r);
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {
      for (; i + 8 <= xr.width; i += 8) store8(rrow + i, load8(rrow + i) + load8(xrow + i));
    }
    for (; i < xr.width; ++i) rrow[i] = from_float<T>(to_float(rrow[i]) + to_float(xrow[i]));
    norm_row(xrow, rrow, wp, xr.width, eps);
  }
}

// Each row holds width / g groups, normed apart; the norm is rounded to T where rms_norm stores
// it, then times silu(z) in f32 and rounded once. out may be x (each group is read first).
template <typename T>
FT_ALWAYS_INLINE void gated_rows(T* op, const RowView& orow, const T* xp, const RowView& xr,
                                 const T* zp, const RowView& zr, const T* wp, int64_t g,
                                 float eps) {
  for (int64_t r = 0; r < xr.rows; ++r) {
    for (int64_t c = 0; c < xr.width; c += g) {
      const T* x = xp + xr.offset(r) + c;
      const T* z = zp + zr.offset(r) + c;
      T* out = op + orow.offset(r) + c;
      const float inv = 1.f / std::sqrt(sum_squares(x, g) / static_cast<float>(g) + eps);
      for (int64_t i = 0; i < g; ++i) {
        float normed = to_float(from_float<T>(to_float(x[i]) * inv * to_float(wp[i])));
        out[i] = from_float<T>(normed * gdn::silu(to_float(z[i])));
      }
    }
  }
}

FT_ISA_CLONES(norm_rows)
FT_ISA_CLONES(gated_rows)
FT_ISA_CLONES(add_norm_rows)

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
    norm_rows_dispatch(data_of<T>(out), orow, data_of<const T>(x), xr, data_of<const T>(weight),
                       static_cast<float>(eps));
  });
}

void fused_add_rms_norm(TensorView x, TensorView residual, TensorView weight, double eps) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(residual, x, "residual", "x");
  check_same_shape(residual, x, "residual", "x");
  RowView xr = row_view(x, 1, "x"), rr = row_view(residual, 1, "residual");
  check_weight(weight, x, xr.width);
  FT_DISPATCH_FLOAT(ft, T, {
    add_norm_rows_dispatch(data_of<T>(x), xr, data_of<T>(residual), rr, data_of<const T>(weight),
                           static_cast<float>(eps));
  });
}

void rms_norm_gated(TensorView out, TensorView x, TensorView z, TensorView weight, double eps) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  check_same_dtype(z, x, "z", "x");
  check_same_dtype(weight, x, "weight", "x");
  TVM_FFI_ICHECK(x.ndim() == 2) << "out, x and z must be [T, W] tensors";
  check_same_shape(out, x, "out", "x");
  check_same_shape(z, x, "z", "x");
  RowView xr = row_view(x, 1, "x"), orow = row_view(out, 1, "out"), zr = row_view(z, 1, "z");
  check_contiguous(weight, "weight");
  TVM_FFI_ICHECK(weight.ndim() == 1 && weight.size(0) > 0 && xr.width % weight.size(0) == 0)
      << "weight must be a [G] tensor whose width G divides the rows' " << xr.width;
  FT_DISPATCH_FLOAT(ft, T, {
    gated_rows_dispatch(data_of<T>(out), orow, data_of<const T>(x), xr, data_of<const T>(z), zr,
                        data_of<const T>(weight), weight.size(0), static_cast<float>(eps));
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rms_norm, freetoken::rms_norm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_add_rms_norm, freetoken::fused_add_rms_norm);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(rms_norm_gated, freetoken::rms_norm_gated);
