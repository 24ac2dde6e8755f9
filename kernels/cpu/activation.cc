// SiLU-and-multiply on the CPU: out = silu(x[:, :d]) * x[:, d:], f32/bf16/f16, math in f32.
#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    v8f g, u;
    for (int l = 0; l < 8; ++l) {
      g[l] = to_float(gate[i + l]);
      u[l] = to_float(up[i + l]);
    }
    v8f y = g / (1.0f + exp8(-g)) * u;
    for (int l = 0; l < 8; ++l) out[i + l] = from_float<T>(y[l]);
  }
  if (i < d) {  // tail: pad one vector so the same exp is used everywhere
    v8f g = {}, u = {};
    for (int64_t l = 0; i + l < d; ++l) {
      g[l] = to_float(gate[i + l]);
      u[l] = to_float(up[i + l]);
    }
    v8f y = g / (1.0f + exp8(-g)) * u;
    for (int64_t l = 0; i + l < d; ++l) out[i + l] = from_float<T>(y[l]);
  }
}

void silu_and_mul(TensorView out, TensorView x) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  RowView xr = row_view(x, 1, "x"), orow = row_view(out, 1, "out");
  TVM_FFI_ICHECK(xr.width % 2 == 0) << "x's last dim must be even (gate and up), got " << xr.width;
  const int64_t d = xr.width / 2;
  TVM_FFI_ICHECK(orow.width == d && orow.rows == xr.rows && out.ndim() == x.ndim())
      << "out must be x's shape with the last dim halved (" << d << ")";
  FT_DISPATCH_FLOAT(ft, T, {
    const T* xp = data_of<T>(x);
    T* op = data_of<T>(out);
    for (int64_t r = 0; r < xr.rows; ++r) {
      const T* row = xp + xr.offset(r);
      silu_mul_row(op + orow.offset(r), row, row + d, d);
    }
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(silu_and_mul, freetoken::silu_and_mul);
