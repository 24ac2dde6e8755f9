// Store new K and V rows into the paged KV pool by slot index (a negative slot is skipped).
// The rows are converted to the pool's dtype (e.g. f32 activations into an f16 pool).
#include <cstring>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

template <typename Src, typename Dst>
void copy_rows(const Src* src, const RowView& view, Dst* cache, const int64_t* slots) {
  for (int64_t t = 0; t < view.rows; ++t) {
    if (slots[t] < 0) continue;
    const Src* s = src + view.offset(t);
    Dst* d = cache + slots[t] * view.width;
    if constexpr (std::is_same_v<Src, Dst>) {
      std::memcpy(d, s, view.width * sizeof(Src));
    } else {
      for (int64_t i = 0; i < view.width; ++i) d[i] = from_float<Dst>(to_float(s[i]));
    }
  }
}

void store_rows(const TensorView& src, const RowView& view, const TensorView& cache,
                const int64_t* slots) {
  FT_DISPATCH_FLOAT(float_type(src, "k/v"), Src, {
    FT_DISPATCH_FLOAT(float_type(cache, "k_cache/v_cache"), Dst, {
      copy_rows(data_of<Src>(src), view, data_of<Dst>(cache), slots);
    });
  });
}

RowView checked_rows(const TensorView& src, const TensorView& cache, const char* src_name,
                     const char* cache_name, int64_t tokens) {
  float_type(src, src_name);
  float_type(cache, cache_name);
  check_contiguous(cache, cache_name);
  RowView view = row_view(src, src.ndim() - 1, src_name);
  TVM_FFI_ICHECK(view.rows == tokens)
      << src_name << " has " << view.rows << " rows but slot_mapping has " << tokens;
  TVM_FFI_ICHECK(cache.ndim() >= 2) << cache_name << " must be [S, Hk, D]";
  bool same = cache.ndim() == src.ndim();
  for (int i = 1; same && i < src.ndim(); ++i) same = cache.size(i) == src.size(i);
  TVM_FFI_ICHECK(same) << src_name << " [T, Hk, D] and " << cache_name
                       << " [S, Hk, D] must agree on every dim after the first";
  return view;
}

void store_kv(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
              TensorView slot_mapping) {
  check_contiguous(slot_mapping, "slot_mapping");
  check_dtype(slot_mapping, kDLInt, 64, "slot_mapping", "int64");
  check_ndim(slot_mapping, 1, "slot_mapping");
  const int64_t tokens = slot_mapping.size(0);
  RowView kv = checked_rows(k, k_cache, "k", "k_cache", tokens);
  RowView vv = checked_rows(v, v_cache, "v", "v_cache", tokens);
  const int64_t num_slots = k_cache.size(0);
  TVM_FFI_ICHECK(v_cache.size(0) == num_slots)
      << "k_cache and v_cache must have the same number of slots";
  const int64_t* slots = data_of<int64_t>(slot_mapping);
  for (int64_t t = 0; t < tokens; ++t) {
    TVM_FFI_ICHECK(slots[t] < num_slots)
        << "slot_mapping[" << t << "] = " << slots[t] << " is outside the KV pool (" << num_slots
        << " slots)";
  }
  store_rows(k, kv, k_cache, slots);
  store_rows(v, vv, v_cache, slots);
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv, freetoken::store_kv);
