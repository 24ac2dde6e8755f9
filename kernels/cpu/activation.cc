// Gated activations on the CPU: out = act(x[:, :d]) * x[:, d:] with act = SiLU or GELU (tanh
// approximation, Gemma's gelu_pytorch_tanh); f32/bf16/f16, math in f32.
// The row loop is compiled twice: for AVX2+FMA (chosen at run time) and for baseline x86-64.
#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

#define FT_ALWAYS_INLINE inline __attribute__((always_inline))

template <typename T>
FT_ALWAYS_INLINE v8f load_as_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) return load8(p);
  v8f v;
  for (int l = 0; l < 8; ++l) v[l] = to_float(p[l]);
  return v;
}

template <typename T>
FT_ALWAYS_INLINE void store_from_float(T* p, const v8f& v) {
  if constexpr (std::is_same_v<T, float>) {
    store8(p, v);
  } else {
    for (int l = 0; l < 8; ++l) p[l] = from_float<T>(v[l]);
  }
}

// GELU-tanh: 0.5 g (1 + tanh(z)) = g * sigmoid(2z), z = sqrt(2 / pi) (g + 0.044715 g^3), so
// both activations are g / (1 + exp(-a)) and share exp8.
template <bool kGelu>
FT_ALWAYS_INLINE v8f act_mul8(const v8f& g, const v8f& u) {
  if constexpr (kGelu) {
    const v8f two_z = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp8(-two_z)) * u;
  }
  return g / (1.0f + exp8(-g)) * u;
}

template <bool kGelu, typename T>
FT_ALWAYS_INLINE void act_mul_row(T* out, const T* gate, const T* up, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    store_from_float(out + i, act_mul8<kGelu>(load_as_float(gate + i), load_as_float(up + i)));
  }
  if (i < d) {  // tail: pad one vector so the same exp is used everywhere
    T g[8] = {}, u[8] = {}, y[8];
    for (int64_t l = 0; i + l < d; ++l) {
      g[l] = gate[i + l];
      u[l] = up[i + l];
    }
    store_from_float(y, act_mul8<kGelu>(load_as_float(g), load_as_float(u)));
    for (int64_t l = 0; i + l < d; ++l) out[i + l] = y[l];
  }
}

template <typename T, bool kGelu>
FT_ALWAYS_INLINE void act_mul_rows(T* op, const RowView& orow, const T* xp, const RowView& xr,
                                   std::integral_constant<bool, kGelu>) {
  const int64_t d = orow.width;
  for (int64_t r = 0; r < xr.rows; ++r) {
    const T* row = xp + xr.offset(r);
    act_mul_row<kGelu>(op + orow.offset(r), row, row + d, d);
  }
}

FT_ISA_CLONES(act_mul_rows)

template <bool kGelu>
void act_and_mul(TensorView out, TensorView x) {
  FloatType ft = float_type(x, "x");
  check_same_dtype(out, x, "out", "x");
  RowView xr = row_view(x, 1, "x"), orow = row_view(out, 1, "out");
  TVM_FFI_ICHECK(xr.width % 2 == 0) << "x's last dim must be even (gate and up), got " << xr.width;
  const int64_t d = xr.width / 2;
  TVM_FFI_ICHECK(orow.width == d && orow.rows == xr.rows && out.ndim() == x.ndim())
      << "out must be x's shape with the last dim halved (" << d << ")";
  FT_DISPATCH_FLOAT(ft, T, {
    act_mul_rows_dispatch(data_of<T>(out), orow, data_of<const T>(x), xr,
                          std::integral_constant<bool, kGelu>());
  });
}

void silu_and_mul(TensorView out, TensorView x) { act_and_mul<false>(out, x); }

void gelu_tanh_and_mul(TensorView out, TensorView x) { act_and_mul<true>(out, x); }

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(silu_and_mul, freetoken::silu_and_mul);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(gelu_tanh_and_mul, freetoken::gelu_tanh_and_mul);
