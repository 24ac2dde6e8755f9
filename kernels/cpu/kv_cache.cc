// Store new K and V rows into the paged KV pool by slot index (a negative slot is skipped).
// The rows are converted to the pool's dtype (e.g. f32 activations into an f16 pool), or
// quantized to the FP8 pool's e4m3 codes with one scale per (token, KV head).
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/fp8_encode.h"

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

// slot_mapping's length, once it is checked to be int64 [T].
int64_t slot_count(const TensorView& slot_mapping) {
  check_contiguous(slot_mapping, "slot_mapping");
  check_dtype(slot_mapping, kDLInt, 64, "slot_mapping", "int64");
  check_ndim(slot_mapping, 1, "slot_mapping");
  return slot_mapping.size(0);
}

// The slots, each checked to lie inside both pools (workers never see a bad index).
const int64_t* checked_slots(const TensorView& slot_mapping, const TensorView& k_cache,
                             const TensorView& v_cache) {
  const int64_t num_slots = k_cache.size(0), tokens = slot_mapping.size(0);
  TVM_FFI_ICHECK(v_cache.size(0) == num_slots)
      << "k_cache and v_cache must have the same number of slots";
  const int64_t* slots = data_of<int64_t>(slot_mapping);
  for (int64_t t = 0; t < tokens; ++t) {
    TVM_FFI_ICHECK(slots[t] < num_slots)
        << "slot_mapping[" << t << "] = " << slots[t] << " is outside the KV pool (" << num_slots
        << " slots)";
  }
  return slots;
}

void store_kv(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
              TensorView slot_mapping) {
  const int64_t tokens = slot_count(slot_mapping);
  RowView kv = checked_rows(k, k_cache, "k", "k_cache", tokens);
  RowView vv = checked_rows(v, v_cache, "v", "v_cache", tokens);
  const int64_t* slots = checked_slots(slot_mapping, k_cache, v_cache);
  store_rows(k, kv, k_cache, slots);
  store_rows(v, vv, v_cache, slots);
}

// ---- FP8 pool: uint8 codes [S, Hk, D] and float32 scales [S, Hk] (freetoken/fp8_encode.h) ----

template <typename Src>
void quantize_rows(const Src* src, const RowView& view, int64_t heads, uint8_t* codes,
                   float* scales, const int64_t* slots) {
  const int64_t d = view.width / heads;
  std::vector<float> row(d);
  for (int64_t t = 0; t < view.rows; ++t) {
    if (slots[t] < 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const Src* s = src + view.offset(t) + h * d;
      float amax = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        row[i] = to_float(s[i]);
        amax = std::fmax(amax, std::fabs(row[i]));
      }
      const float scale = fp8::row_scale(amax);
      uint8_t* out = codes + (slots[t] * heads + h) * d;
      for (int64_t i = 0; i < d; ++i) out[i] = fp8::float_to_e4m3(row[i] / scale);
      scales[slots[t] * heads + h] = scale;
    }
  }
}

void check_fp8_pool(const TensorView& src, const TensorView& codes, const TensorView& scales,
                    const char* src_name, const char* codes_name, const char* scales_name,
                    int64_t tokens, RowView* view) {
  float_type(src, src_name);
  check_dtype(codes, kDLUInt, 8, codes_name, "uint8 (e4m3 codes)");
  check_dtype(scales, kDLFloat, 32, scales_name, "float32");
  check_contiguous(codes, codes_name);
  check_contiguous(scales, scales_name);
  check_ndim(codes, 3, codes_name);
  check_ndim(src, 3, src_name);
  TVM_FFI_ICHECK(src.size(1) == codes.size(1) && src.size(2) == codes.size(2))
      << src_name << " [T, Hk, D] and " << codes_name << " [S, Hk, D] must agree on Hk and D";
  TVM_FFI_ICHECK(scales.ndim() == 2 && scales.size(0) == codes.size(0) &&
                 scales.size(1) == codes.size(1))
      << scales_name << " must be [S, Hk] = [" << codes.size(0) << ", " << codes.size(1) << "]";
  *view = row_view(src, 2, src_name);
  TVM_FFI_ICHECK(view->rows == tokens)
      << src_name << " has " << view->rows << " rows but slot_mapping has " << tokens;
}

void store_kv_fp8(TensorView k, TensorView v, TensorView k_cache, TensorView v_cache,
                  TensorView k_scale, TensorView v_scale, TensorView slot_mapping) {
  const int64_t tokens = slot_count(slot_mapping);
  RowView kv, vv;
  check_fp8_pool(k, k_cache, k_scale, "k", "k_cache", "k_scale", tokens, &kv);
  check_fp8_pool(v, v_cache, v_scale, "v", "v_cache", "v_scale", tokens, &vv);
  const int64_t* slots = checked_slots(slot_mapping, k_cache, v_cache);
  const int64_t heads = k_cache.size(1);
  for (auto [src, view, codes, scales] :
       {std::tuple{&k, &kv, &k_cache, &k_scale}, std::tuple{&v, &vv, &v_cache, &v_scale}}) {
    FT_DISPATCH_FLOAT(float_type(*src, "k/v"), Src, {
      quantize_rows(data_of<Src>(*src), *view, heads, data_of<uint8_t>(*codes),
                    data_of<float>(*scales), slots);
    });
  }
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv, freetoken::store_kv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(store_kv_fp8, freetoken::store_kv_fp8);
