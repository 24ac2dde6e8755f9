// Arguments of the CPU MoE kernels: weight formats, shapes and the checks that build them.
// Every input is validated here, on the calling thread, because the pool's workers must not
// throw; each message names the argument and the shape or range it must have.
#pragma once

#include <sstream>
#include <string>

#include "freetoken/cpu_common.h"
#include "freetoken/float_rows.h"
#include "freetoken/quant_blocks.h"
#include "freetoken/scaled_cpu_args.h"

namespace freetoken {
namespace moe {

/*! \brief How one weight tensor stores its rows: a GGML type id, or floatrows::kE4M3. */
struct Format {
  int64_t type = floatrows::kF32;
  bool quantized = false;  // GGUF blocks (else float elements: f32/f16/bf16 or FP8 codes)
  bool packed = false;     // the blocks in quant_packed.h's 16-row layout (quant_pack)
  scaled::Fp8Layout fp8;   // FP8 codes (type kE4M3): their scale grids and row scales

  /*! \brief Bytes of one row of k weights. */
  int64_t row_bytes(int64_t k) const {
    return quantized ? quant::row_bytes_of(type, k) : k * floatrows::element_bytes(type);
  }

  /*! \brief Bytes from one row to the next in w [S, rows, pitch]: the row's bytes, or (GGUF
   * rows, not packed) those padded to whole 16-byte words as the GPU keeps them, so an expert
   * offload's host blocks serve the CPU too. */
  int64_t pitch(const TensorView& w, int64_t k) const {
    return quantized && !packed && w.size(2) == (row_bytes(k) + 15) / 16 * 16 ? w.size(2)
                                                                             : row_bytes(k);
  }
};

inline const char* type_name(int64_t type) {
  switch (type) {
    case 0: return "F32";
    case 1: return "F16";
    case 30: return "BF16";
    case 2: return "Q4_0";
    case 3: return "Q4_1";
    case 6: return "Q5_0";
    case 7: return "Q5_1";
    case 8: return "Q8_0";
    case 12: return "Q4_K";
    case 13: return "Q5_K";
    case 14: return "Q6_K";
    case floatrows::kE4M3: return "FP8 e4m3";
    default: return "unknown";
  }
}

inline Format format_of(int64_t type, const char* name) {
  Format f{type, quant::block_bytes(type) > 0};
  TVM_FFI_ICHECK(f.quantized || floatrows::element_bytes(type) > 0)
      << name << " = " << type << " is not supported: use F32 (0), F16 (1), BF16 (30), "
      << quant::kSupportedTypes;
  return f;
}

inline std::string dims_of(const TensorView& t) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < t.ndim(); ++i) s << (i ? ", " : "") << t.size(i);
  s << "]";
  return s.str();
}

/*! \brief T tokens, hidden H, top-K, E experts, S expert slots, intermediate I. */
struct Shape {
  int64_t t = 0, h = 0, k = 0, e = 0, s = 0, i = 0;
};

// A weight tensor [S, rows, row_bytes-or-elements] in format f whose rows hold `k` weights.
inline void check_weight(const TensorView& w, const char* name, const Format& f, bool bytes,
                         int64_t s, int64_t rows, int64_t k, const char* want) {
  check_contiguous(w, name);
  if (bytes) {
    check_dtype(w, kDLUInt, 8, name,
                f.type == floatrows::kE4M3 ? "uint8 (e4m3 codes)" : "uint8 (GGUF rows)");
  } else {
    check_dtype(w, kDLFloat, 32, name, "float32");
  }
  TVM_FFI_ICHECK(w.ndim() == 3) << name << " must be " << want << " (3-D), got " << dims_of(w);
  const int64_t last = bytes ? f.pitch(w, k) : k;
  TVM_FFI_ICHECK(!f.quantized || k % quant::block_weights(f.type) == 0)
      << name << " rows hold " << k << " weights, not a multiple of "
      << quant::block_weights(f.type) << " as " << type_name(f.type) << " blocks need";
  TVM_FFI_ICHECK(w.ndim() == 3 && w.size(0) == s && w.size(1) == rows && w.size(2) == last)
      << name << " must be " << want << " = [" << s << ", " << rows << ", " << last << "]"
      << (bytes ? std::string(" (") + type_name(f.type) + " rows of " + std::to_string(k) + " weights)"
                : std::string())
      << ", got " << dims_of(w);
}

// topk_ids int32 [T, K] within [0, E); topk_weights f32 [T, K]; expert_map int32 [E] in [0, S).
inline void check_routing(const TensorView& topk_ids, const TensorView& topk_weights,
                          const TensorView& expert_map, Shape& sh) {
  check_contiguous(topk_ids, "topk_ids");
  check_dtype(topk_ids, kDLInt, 32, "topk_ids", "int32");
  check_contiguous(topk_weights, "topk_weights");
  check_dtype(topk_weights, kDLFloat, 32, "topk_weights", "float32");
  check_contiguous(expert_map, "expert_map");
  check_dtype(expert_map, kDLInt, 32, "expert_map", "int32");
  TVM_FFI_ICHECK(topk_ids.ndim() == 2 && topk_ids.size(0) == sh.t)
      << "topk_ids must be [T=" << sh.t << ", K], got " << dims_of(topk_ids);
  sh.k = topk_ids.size(1);
  TVM_FFI_ICHECK(topk_weights.ndim() == 2 && topk_weights.size(0) == sh.t &&
                 topk_weights.size(1) == sh.k)
      << "topk_weights must be [T=" << sh.t << ", K=" << sh.k << "] like topk_ids, got "
      << dims_of(topk_weights);
  TVM_FFI_ICHECK(expert_map.ndim() == 1 && expert_map.size(0) > 0)
      << "expert_map must be [E] with E >= 1, got " << dims_of(expert_map);
  sh.e = expert_map.size(0);
  const int32_t* map = data_of<int32_t>(expert_map);
  for (int64_t j = 0; j < sh.e; ++j) {
    TVM_FFI_ICHECK(map[j] >= 0 && map[j] < sh.s)
        << "expert_map[" << j << "] = " << map[j] << " is outside the S=" << sh.s
        << " expert slots of w13/w2";
  }
  const int32_t* ids = data_of<int32_t>(topk_ids);
  for (int64_t q = 0; q < sh.t * sh.k; ++q) {
    TVM_FFI_ICHECK(ids[q] >= 0 && ids[q] < sh.e)
        << "topk_ids[" << q / sh.k << ", " << q % sh.k << "] = " << ids[q]
        << " is outside the E=" << sh.e << " experts of expert_map";
  }
}

/*!
 * \brief Checks every argument of moe_experts (bytes = false: f32 weights) or moe_experts_quant
 * (bytes = true: uint8 rows in f13 / f2) and returns the shape.
 */
inline Shape check_experts(const TensorView& out, const TensorView& x, const TensorView& w13,
                           const TensorView& w2, const Format& f13, const Format& f2, bool bytes,
                           const TensorView& topk_ids, const TensorView& topk_weights,
                           const TensorView& expert_map, const TensorView& workspace) {
  Shape sh;
  check_contiguous(x, "x");
  check_dtype(x, kDLFloat, 32, "x", "float32");
  check_ndim(x, 2, "x");
  sh.t = x.size(0);
  sh.h = x.size(1);
  check_contiguous(out, "out");
  check_dtype(out, kDLFloat, 32, "out", "float32");
  TVM_FFI_ICHECK(out.ndim() == 2 && out.size(0) == sh.t && out.size(1) == sh.h)
      << "out must be [T=" << sh.t << ", H=" << sh.h << "] like x, got " << dims_of(out);
  TVM_FFI_ICHECK(w13.ndim() == 3 && w13.size(1) % 2 == 0)
      << "w13 must be [S, 2I, " << (bytes ? "row bytes" : "H") << "] (gate rows, then up rows), got "
      << dims_of(w13);
  sh.s = w13.size(0);
  sh.i = w13.size(1) / 2;
  check_weight(w13, "w13", f13, bytes, sh.s, 2 * sh.i, sh.h, "[S, 2I, H]");
  check_weight(w2, "w2", f2, bytes, sh.s, sh.h, sh.i, "[S, H, I]");
  check_cpu(workspace, "workspace");  // the CPU kernel needs no scratch from the caller
  check_routing(topk_ids, topk_weights, expert_map, sh);
  return sh;
}

}  // namespace moe
}  // namespace freetoken
