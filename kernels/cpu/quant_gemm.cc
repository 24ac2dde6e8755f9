// GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrix product on the CPU with runtime ISA dispatch in one library:
// AVX-512 VNNI, AVX2 or portable scalar, chosen once from the CPU's features.
//
// out[M, N] = x[M, K] @ dequant(qweight[N, row_bytes]).T. x is quantized to int8 in 32-blocks
// once per call (one scale per block, or per super-block for the K-quants: see quant_blocks.h),
// then each output is a sum of integer block dot products; the weight rows are split over the
// thread pool.
#include <algorithm>
#include <string>
#include <vector>

#include "freetoken/cpu_common.h"
#include "freetoken/quant_dispatch.h"
#include "freetoken/quant_packed.h"

namespace freetoken {
namespace quant {
namespace {

struct MatmulShape {
  int64_t m, k, n, row_bytes;
};

MatmulShape check_matmul(const TensorView& out, const TensorView& x, const TensorView& qweight,
                         int64_t qtype) {
  TVM_FFI_ICHECK(block_bytes(qtype) > 0)
      << "qtype " << qtype << " is not supported: use " << kSupportedTypes;
  check_contiguous(x, "x");
  check_contiguous(out, "out");
  check_contiguous(qweight, "qweight");
  check_dtype(x, kDLFloat, 32, "x", "float32");
  check_dtype(out, kDLFloat, 32, "out", "float32");
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_ndim(x, 2, "x");
  check_ndim(out, 2, "out");
  check_ndim(qweight, 2, "qweight");
  MatmulShape s{x.size(0), x.size(1), qweight.size(0), qweight.size(1)};
  TVM_FFI_ICHECK(s.k % block_weights(qtype) == 0)
      << "x's last dim (K = " << s.k << ") must be a multiple of " << block_weights(qtype)
      << " for qtype " << qtype;
  TVM_FFI_ICHECK(s.row_bytes == row_bytes_of(qtype, s.k))
      << "qweight rows hold " << s.row_bytes << " bytes but K = " << s.k << " needs "
      << row_bytes_of(qtype, s.k) << " for qtype " << qtype;
  TVM_FFI_ICHECK(out.size(0) == s.m && out.size(1) == s.n)
      << "out must be [" << s.m << ", " << s.n << "] (x rows, qweight rows)";
  return s;
}

// Per-thread scratch for the quantized activations, grown on demand and reused across calls.
QuantizedRows quantized_buffer(int64_t rows, int64_t blocks) {
  thread_local std::vector<uint8_t> storage;
  const int64_t q_bytes = (rows * blocks * kBlock + 63) / 64 * 64;
  const size_t need = q_bytes + 2 * rows * blocks * sizeof(float);
  if (storage.size() < need) storage.resize(need);
  QuantizedRows xq;
  xq.rows = rows;
  xq.blocks = blocks;
  xq.q = reinterpret_cast<int8_t*>(storage.data());
  xq.d = reinterpret_cast<float*>(storage.data() + q_bytes);
  xq.s = xq.d + rows * blocks;
  return xq;
}

// Weight bytes a decode chunk holds at least: claiming a chunk moves the pool's counter between
// cores and restarts the prefetch stream, which cost ~0.2 us a chunk (SmolLM2's 576-row o
// projection, 29 chunks: 8.3 -> 7.0 us).
constexpr int64_t kDecodeChunkBytes = 65536;

// Weight rows per decode chunk: up to 16 chunks a thread balance the cores, but none smaller
// than kDecodeChunkBytes, and a multiple of the thread count of about equal chunks.
int64_t decode_grain(const MatmulShape& s, int64_t threads) {
  int64_t chunks = std::clamp<int64_t>(s.n * s.row_bytes / kDecodeChunkBytes, 1, threads * 16);
  chunks = (chunks + threads - 1) / threads * threads;
  return std::max<int64_t>(16, (s.n + chunks - 1) / chunks);
}

// x's rows as int8 blocks for weights of `qtype` (on the pool from 8 rows), in the calling
// thread's buffers; with `sum16` (packed Q6_K) each 16 values' sum as well.
QuantizedRows quantize_x(Isa isa, int64_t qtype, const MatmulShape& s, const float* x,
                         bool sum16) {
  QuantizedRows xq = quantized_buffer(s.m, s.k / kBlock);
  thread_local std::vector<int32_t> sum16_storage;
  int32_t* sums = nullptr;  // a plain pointer: a worker naming the thread_local sees its own
  if (sum16) {
    sum16_storage.resize(2 * s.m * xq.blocks);
    xq.sum16 = sums = sum16_storage.data();
  }
  auto rows = [&](int64_t r0, int64_t r1) {
    quantize(isa, qtype, x, s.k, r0, r1, xq);
    if (sums != nullptr) fill_sum16(xq, r0, r1, sums);
  };
  const int64_t threads = thread_pool().num_threads();
  if (s.m < 8) {
    rows(0, s.m);
  } else {
    parallel_for(s.m, (s.m + threads * 4 - 1) / (threads * 4), rows);
  }
  return xq;
}

void run_matmul(Isa isa, TensorView out, TensorView x, TensorView qweight, int64_t qtype) {
  const MatmulShape s = check_matmul(out, x, qweight, qtype);
  if (s.m == 0 || s.n == 0) return;
  const uint8_t* wp = data_of<uint8_t>(qweight);
  float* op = data_of<float>(out);
  const QuantizedRows xq = quantize_x(isa, qtype, s, data_of<float>(x), false);
  const int64_t threads = thread_pool().num_threads();
  // Prefill keeps a chunk's weight rows (<= 16) in L1 while every activation tile passes over
  // them; decode streams the weights once (decode_grain).
  int64_t grain = s.m == 1 ? decode_grain(s, threads)
                           : std::max<int64_t>(4, std::min<int64_t>(16, s.n / (threads * 4)));
  grain = (grain + 3) / 4 * 4;  // whole tiles of four weight rows
  parallel_for(s.n, grain, [&](int64_t n0, int64_t n1) {
    matmul_rows(isa, wp, s.row_bytes, qtype, n0, n1, xq, op, s.n);
  });
}

void quant_matmul(TensorView out, TensorView x, TensorView qweight, int64_t qtype) {
  run_matmul(best_isa(), out, x, qweight, qtype);
}

void check_packable(const TensorView& qweight, int64_t qtype) {
  TVM_FFI_ICHECK(packable_type(qtype))
      << "qtype " << qtype << " has no packed layout: only Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), "
      << "Q8_0 (8), Q4_K (12) and Q6_K (14) do";
  TVM_FFI_ICHECK(best_isa() == Isa::kAvx512)
      << "packed weights need AVX-512 VNNI, which this CPU lacks (best: "
      << isa_name(best_isa()) << "); keep the GGUF layout (quant_matmul)";
  TVM_FFI_ICHECK(qweight.size(0) % kPackRows == 0)
      << "packed weights need a multiple of " << kPackRows << " rows, not " << qweight.size(0);
}

// out = qweight's GGUF rows in the packed layout (quant_packed.h); same shape and bytes.
void quant_pack(TensorView out, TensorView qweight, int64_t qtype) {
  check_contiguous(qweight, "qweight");
  check_contiguous(out, "out");
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_dtype(out, kDLUInt, 8, "out", "uint8");
  check_ndim(qweight, 2, "qweight");
  check_packable(qweight, qtype);
  TVM_FFI_ICHECK(out.size(0) == qweight.size(0) && out.size(1) == qweight.size(1))
      << "out must have qweight's shape [" << qweight.size(0) << ", " << qweight.size(1) << "]";
  TVM_FFI_ICHECK(qweight.size(1) % block_bytes(qtype) == 0)
      << "qweight rows (" << qweight.size(1) << " bytes) are not whole blocks of qtype " << qtype;
  const uint8_t* src = data_of<uint8_t>(qweight);
  uint8_t* dst = data_of<uint8_t>(out);
  TVM_FFI_ICHECK(src != dst) << "quant_pack cannot work in place: out must be another buffer";
  const int64_t row_bytes = qweight.size(1);
  parallel_for(qweight.size(0) / kPackRows, 16, [&](int64_t t0, int64_t t1) {
    pack_tiles(src, dst, row_bytes, qtype, t0, t1);
  });
}

// quant_matmul over weights in the packed layout (quant_pack's out).
void quant_matmul_packed(TensorView out, TensorView x, TensorView packed, int64_t qtype) {
  const MatmulShape s = check_matmul(out, x, packed, qtype);
  check_packable(packed, qtype);
  if (s.m == 0 || s.n == 0) return;
  const QuantizedRows xq =
      quantize_x(Isa::kAvx512, qtype, s, data_of<float>(x), needs_sum16(qtype));
  const int64_t threads = thread_pool().num_threads();
  const int64_t tiles = s.n / kPackRows;
  const int64_t grain =
      s.m <= kStreamRows ? (decode_grain(s, threads) + kPackRows - 1) / kPackRows : 1;
  const uint8_t* wp = data_of<uint8_t>(packed);
  float* op = data_of<float>(out);
  parallel_for(tiles, grain, [&](int64_t t0, int64_t t1) {
    packed::matmul_tiles(wp, s.row_bytes, qtype, t0, t1, xq, op, s.n);
  });
}

void quant_matmul_isa(TensorView out, TensorView x, TensorView qweight, int64_t qtype,
                      std::string isa) {
  run_matmul(parse_isa(isa), out, x, qweight, qtype);
}

void dequantize_rows(TensorView out, TensorView ids, TensorView qweight, int64_t qtype) {
  TVM_FFI_ICHECK(block_bytes(qtype) > 0)
      << "qtype " << qtype << " is not supported: use " << kSupportedTypes;
  check_contiguous(ids, "ids");
  check_dtype(ids, kDLInt, 64, "ids", "int64");
  check_ndim(ids, 1, "ids");
  check_contiguous(qweight, "qweight");
  check_dtype(qweight, kDLUInt, 8, "qweight", "uint8");
  check_ndim(qweight, 2, "qweight");
  check_contiguous(out, "out");
  check_dtype(out, kDLFloat, 32, "out", "float32");
  check_ndim(out, 2, "out");
  const int64_t rows = qweight.size(0), row_bytes = qweight.size(1), t = ids.size(0);
  const int64_t blocks = row_bytes / block_bytes(qtype) * (block_weights(qtype) / kBlock);
  TVM_FFI_ICHECK(row_bytes % block_bytes(qtype) == 0)
      << "qweight rows (" << row_bytes << " bytes) are not whole blocks of qtype " << qtype;
  TVM_FFI_ICHECK(out.size(0) == t && out.size(1) == blocks * kBlock)
      << "out must be [" << t << ", " << blocks * kBlock << "]";
  const int64_t* idp = data_of<int64_t>(ids);
  for (int64_t i = 0; i < t; ++i) {
    TVM_FFI_ICHECK(idp[i] >= 0 && idp[i] < rows)
        << "id " << idp[i] << " (ids[" << i << "]) is outside qweight's " << rows << " rows";
  }
  const uint8_t* wp = data_of<uint8_t>(qweight);
  float* op = data_of<float>(out);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t b = 0; b < blocks; ++b) {
      dequantize_block(wp + idp[i] * row_bytes, qtype, b, op + (i * blocks + b) * kBlock);
    }
  }
}

std::string cpu_isa() { return isa_name(best_isa()); }

int64_t set_num_threads(int64_t n) {
  thread_pool().set_num_threads(static_cast<int>(n));
  return thread_pool().num_threads();
}

}  // namespace
}  // namespace quant
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(quant_matmul, freetoken::quant::quant_matmul);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quant_matmul_isa, freetoken::quant::quant_matmul_isa);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quant_pack, freetoken::quant::quant_pack);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(quant_matmul_packed, freetoken::quant::quant_matmul_packed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dequantize_rows, freetoken::quant::dequantize_rows);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(cpu_isa, freetoken::quant::cpu_isa);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(set_num_threads, freetoken::quant::set_num_threads);
