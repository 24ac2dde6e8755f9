// Shared helpers for the cpu-x86_64 kernels: argument checks, float dtype dispatch,
// bf16/fp16 conversion, a vectorizable exp, and a small persistent thread pool.
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>
#include <cstring>

#include "freetoken/cpu_thread_pool.h"

namespace freetoken {

using tvm::ffi::TensorView;

// ---------------------------------------------------------------- dtypes and checks

enum class FloatType { kF32, kBF16, kF16 };

inline bool has_dtype(const TensorView& t, DLDataTypeCode code, int bits) {
  DLDataType d = t.dtype();
  return d.code == code && d.bits == bits && d.lanes == 1;
}

inline const char* dtype_name(DLDataType d) {
  if (d.lanes != 1) return "vector";
  switch (d.code) {
    case kDLFloat: return d.bits == 32 ? "float32" : d.bits == 16 ? "float16" : d.bits == 64 ? "float64" : "float";
    case kDLBfloat: return "bfloat16";
    case kDLInt: return d.bits == 64 ? "int64" : d.bits == 32 ? "int32" : d.bits == 8 ? "int8" : "int";
    case kDLUInt: return d.bits == 8 ? "uint8" : "uint";
    case kDLBool: return "bool";
    default: return "unknown";
  }
}

inline void check_cpu(const TensorView& t, const char* name) {
  TVM_FFI_ICHECK(t.device().device_type == kDLCPU)
      << name << " must be a CPU tensor (device type " << t.device().device_type << ")";
}

inline void check_contiguous(const TensorView& t, const char* name) {
  check_cpu(t, name);
  TVM_FFI_ICHECK(t.IsContiguous()) << name << " must be contiguous (call .contiguous())";
}

inline void check_dtype(const TensorView& t, DLDataTypeCode code, int bits, const char* name,
                        const char* wanted) {
  TVM_FFI_ICHECK(has_dtype(t, code, bits))
      << name << " must be " << wanted << ", got " << dtype_name(t.dtype());
}

inline void check_ndim(const TensorView& t, int ndim, const char* name) {
  TVM_FFI_ICHECK(t.ndim() == ndim) << name << " must have " << ndim << " dims, got " << t.ndim();
}

/*! \brief The float dtype of `t` (float32, bfloat16 or float16); anything else raises. */
inline FloatType float_type(const TensorView& t, const char* name) {
  if (has_dtype(t, kDLFloat, 32)) return FloatType::kF32;
  if (has_dtype(t, kDLBfloat, 16)) return FloatType::kBF16;
  if (has_dtype(t, kDLFloat, 16)) return FloatType::kF16;
  TVM_FFI_THROW(RuntimeError) << name << " must be float32, bfloat16 or float16, got "
                              << dtype_name(t.dtype());
  return FloatType::kF32;
}

inline void check_same_dtype(const TensorView& a, const TensorView& b, const char* name_a,
                             const char* name_b) {
  DLDataType x = a.dtype(), y = b.dtype();
  TVM_FFI_ICHECK(x.code == y.code && x.bits == y.bits && x.lanes == y.lanes)
      << name_a << " (" << dtype_name(x) << ") and " << name_b << " (" << dtype_name(y)
      << ") must have the same dtype";
}

template <typename T>
inline T* data_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

/*!
 * \brief A tensor seen as `rows` rows of `width` contiguous elements. The leading dims may have
 * any strides (a head slice of a fused projection output, say); offset(r) finds row r.
 */
struct RowView {
  static constexpr int kMaxLead = 8;
  int64_t rows = 1, width = 0;
  int lead = 0;  // leading dims of size > 1, outermost first
  int64_t size[kMaxLead] = {}, stride[kMaxLead] = {};

  int64_t offset(int64_t r) const {
    if (lead <= 1) return lead == 0 ? 0 : r * stride[0];
    int64_t off = 0;
    for (int i = lead - 1; i >= 0; --i) {
      off += (r % size[i]) * stride[i];
      r /= size[i];
    }
    return off;
  }
  /*! \brief The distance between consecutive rows, or -1 when rows are not evenly spaced. */
  int64_t uniform_stride() const { return lead == 0 ? width : lead == 1 ? stride[0] : -1; }
};

/*! \brief View `t` as rows whose last `inner_dims` dims are contiguous. */
inline RowView row_view(const TensorView& t, int inner_dims, const char* name) {
  check_cpu(t, name);
  const int nd = t.ndim();
  TVM_FFI_ICHECK(nd >= inner_dims && inner_dims >= 1 && nd - inner_dims <= RowView::kMaxLead)
      << name << " must have between " << inner_dims << " and " << inner_dims + RowView::kMaxLead
      << " dims, got " << nd;
  RowView v;
  v.width = 1;
  for (int i = nd - inner_dims; i < nd; ++i) v.width *= t.size(i);
  const bool contiguous = t.IsContiguous();
  int64_t expected = 1;
  for (int i = nd - 1; i >= nd - inner_dims && !contiguous; --i) {
    TVM_FFI_ICHECK(t.size(i) == 1 || t.stride(i) == expected)
        << name << " must have contiguous rows (its last " << inner_dims << " dims)";
    expected *= t.size(i);
  }
  for (int i = 0; i < nd - inner_dims; ++i) {
    v.rows *= t.size(i);
    if (t.size(i) == 1) continue;  // size-1 dims carry arbitrary strides: skip them
    int64_t inner = 1;             // contiguous tensors may have no strides array
    for (int j = i + 1; j < nd && contiguous; ++j) inner *= t.size(j);
    v.size[v.lead] = t.size(i);
    v.stride[v.lead++] = contiguous ? inner : t.stride(i);
  }
  return v;
}

// ---------------------------------------------------------------- bf16 / fp16

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

// Branch-free so the compiler can vectorize it: the half's exponent and mantissa moved into a
// float and scaled by 2^112 is exact for normals and subnormals; inf/NaN are patched in.
inline float f16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  float mag = bits_float(em << 13) * 0x1p112f;
  uint32_t out = em >= 0x7c00u ? (0x7f800000u | ((em & 0x3ffu) << 13)) : float_bits(mag);
  return bits_float(sign | out);
}

inline uint16_t float_to_f16(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // at or past 65520: rounds to infinity
  if (ax < 0x38800000u) {                          // below 2^-14: half subnormal (or zero)
    if (ax < 0x33000000u) return sign;             // below 2^-25: rounds to zero
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14..24
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t h = (ax >> 13) - (112u << 10);  // rebias the exponent from 127 to 15
  uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return bf16_to_float(v.bits); }
inline float to_float(f16 v) { return f16_to_float(v.bits); }

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline bf16 from_float<bf16>(float v) { return bf16{float_to_bf16(v)}; }
template <>
inline f16 from_float<f16>(float v) { return f16{float_to_f16(v)}; }

/*! \brief Run `...` with `T` bound to the C++ type of a FloatType. */
#define FT_DISPATCH_FLOAT(ftype, T, ...)            \
  switch (ftype) {                                  \
    case ::freetoken::FloatType::kF32: {            \
      using T = float;                              \
      __VA_ARGS__;                                  \
      break;                                        \
    }                                               \
    case ::freetoken::FloatType::kBF16: {           \
      using T = ::freetoken::bf16;                  \
      __VA_ARGS__;                                  \
      break;                                        \
    }                                               \
    case ::freetoken::FloatType::kF16: {            \
      using T = ::freetoken::f16;                   \
      __VA_ARGS__;                                  \
      break;                                        \
    }                                               \
  }

// ---------------------------------------------------------------- vector math

/*! \brief True when the CPU runs AVX2 and FMA (the ops' `target("avx2,fma")` clones). */
inline bool cpu_has_avx2_fma() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return yes;
}

/*!
 * \brief Defines NAME_avx2 (compiled for AVX2+FMA) and NAME_baseline forwarding to NAME, which
 * must be always-inline so its body, v8f math included, is compiled for each ISA.
 */
#define FT_ISA_CLONES(NAME)                                                             \
  template <typename... Args>                                                           \
  __attribute__((target("avx2,fma"))) void NAME##_avx2(Args... args) {                  \
    NAME(args...);                                                                      \
  }                                                                                     \
  template <typename... Args>                                                           \
  void NAME##_baseline(Args... args) {                                                  \
    NAME(args...);                                                                      \
  }                                                                                     \
  template <typename... Args>                                                           \
  void NAME##_dispatch(Args... args) {                                                  \
    if (::freetoken::cpu_has_avx2_fma()) {                                              \
      NAME##_avx2(args...);                                                             \
    } else {                                                                            \
      NAME##_baseline(args...);                                                         \
    }                                                                                   \
  }

#pragma GCC diagnostic ignored "-Wpsabi"  // v8f helpers are always inlined: no ABI crosses

// GCC vector extensions: lowered to SSE2 in baseline code and to AVX2/AVX-512 when inlined into a
// function compiled for those targets, so one source serves every ISA clone.
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4)));

inline __attribute__((always_inline)) v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline __attribute__((always_inline)) void store8(float* p, const v8f& v) { std::memcpy(p, &v, sizeof(v)); }

inline __attribute__((always_inline)) float hsum8(v8f v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

/*! \brief exp over 8 lanes (relative error ~2e-7); inputs below -87 give exactly 0. */
inline __attribute__((always_inline)) v8f exp8(const v8f& x) {
  const v8f lo = v8f{} - 87.0f, hi = v8f{} + 88.0f;
  v8f xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  // x = n*ln2 + r with |r| <= ln2/2; the 1.5*2^23 shift rounds x*log2(e) to an integer.
  const v8f shift = v8f{} + 12582912.0f;
  v8f t = xc * 1.44269504088896341f + shift;
  v8f n = t - shift;
  v8f r = xc - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  v8f p = v8f{} + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  v8i ni = __builtin_convertvector(n, v8i);
  v8f out = (v8f)((v8i)p + (ni << 23));  // vector casts reinterpret the bits
  return x < lo ? v8f{} : out;
}

}  // namespace freetoken
