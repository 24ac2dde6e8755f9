// Rotary position embedding on the CPU, in place on q and k: neox (rotate halves) and
// interleaved (rotate pairs) layouts, partial rotation (rot_dim < head_dim), f32/bf16/f16.
#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

#define FT_ALWAYS_INLINE inline __attribute__((always_inline))

// Rotates one head in place; x1 = a[i * step], x2 = a[i * step + partner] for i < half.
template <typename T>
FT_ALWAYS_INLINE void rotate_head(T* x, const float* cos, const float* sin, int64_t half,
                                  bool is_neox) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; is_neox && i + 8 <= half; i += 8) {  // halves are contiguous: 8 pairs at a time
      const v8f x1 = load8(x + i), x2 = load8(x + half + i), c = load8(cos + i), s = load8(sin + i);
      store8(x + i, x1 * c - x2 * s);
      store8(x + half + i, x2 * c + x1 * s);
    }
  }
  // neox pairs element i with i + half; interleaved pairs 2i with 2i + 1
  const int64_t step = is_neox ? 1 : 2, partner = is_neox ? half : 1;
  for (; i < half; ++i) {
    T* a = x + i * step;
    T* b = a + partner;
    float x1 = to_float(*a), x2 = to_float(*b);
    *a = from_float<T>(x1 * cos[i] - x2 * sin[i]);
    *b = from_float<T>(x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
FT_ALWAYS_INLINE void rotate_rows(T* data, const RowView& view, int64_t head_dim,
                                  const int64_t* positions, const float* cos_sin, int64_t rot_dim,
                                  bool is_neox) {
  const int64_t half = rot_dim / 2, heads = view.width / head_dim;
  for (int64_t t = 0; t < view.rows; ++t) {
    const float* cos = cos_sin + positions[t] * rot_dim;
    for (int64_t h = 0; h < heads; ++h) {
      rotate_head(data + view.offset(t) + h * head_dim, cos, cos + half, half, is_neox);
    }
  }
}

FT_ISA_CLONES(rotate_rows)

// Checks one of q / k before anything is written, so a bad k leaves q untouched.
RowView checked_view(const TensorView& t, const char* name, int64_t tokens, int64_t head_dim) {
  float_type(t, name);
  RowView view = row_view(t, t.ndim() - 1, name);
  TVM_FFI_ICHECK(view.rows == tokens)
      << name << " has " << view.rows << " rows but positions has " << tokens;
  TVM_FFI_ICHECK(view.width % head_dim == 0)
      << name << " row width " << view.width << " is not a multiple of head_dim " << head_dim;
  return view;
}

void rotate(TensorView t, const RowView& view, int64_t head_dim, const int64_t* positions,
            const float* cos_sin, int64_t rot_dim, bool is_neox) {
  FT_DISPATCH_FLOAT(float_type(t, "q/k"), T, {
    rotate_rows_dispatch(data_of<T>(t), view, head_dim, positions, cos_sin, rot_dim, is_neox);
  });
}

void rotary_embedding(TensorView positions, TensorView q, TensorView k, TensorView cos_sin_cache,
                      int64_t head_dim, bool is_neox) {
  check_contiguous(positions, "positions");
  check_dtype(positions, kDLInt, 64, "positions", "int64");
  check_ndim(positions, 1, "positions");
  check_contiguous(cos_sin_cache, "cos_sin_cache");
  check_dtype(cos_sin_cache, kDLFloat, 32, "cos_sin_cache", "float32");
  check_ndim(cos_sin_cache, 2, "cos_sin_cache");
  const int64_t max_pos = cos_sin_cache.size(0), rot_dim = cos_sin_cache.size(1);
  TVM_FFI_ICHECK(head_dim > 0) << "head_dim must be positive, got " << head_dim;
  TVM_FFI_ICHECK(rot_dim > 0 && rot_dim % 2 == 0 && rot_dim <= head_dim)
      << "cos_sin_cache.shape[1] (rot_dim " << rot_dim << ") must be even and at most head_dim "
      << head_dim;
  const int64_t tokens = positions.size(0);
  const int64_t* pos = data_of<int64_t>(positions);
  for (int64_t t = 0; t < tokens; ++t) {
    TVM_FFI_ICHECK(pos[t] >= 0 && pos[t] < max_pos)
        << "positions[" << t << "] = " << pos[t] << " is outside the cos_sin_cache (" << max_pos
        << " positions)";
  }
  RowView qv = checked_view(q, "q", tokens, head_dim), kv = checked_view(k, "k", tokens, head_dim);
  const float* cs = data_of<float>(cos_sin_cache);
  rotate(q, qv, head_dim, pos, cs, rot_dim, is_neox);
  rotate(k, kv, head_dim, pos, cs, rot_dim, is_neox);
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(rotary_embedding, freetoken::rotary_embedding);
