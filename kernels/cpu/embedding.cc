// Embedding lookup on the CPU: out[t] = table[ids[t]], converted to out's dtype.
#include <cstring>

#include "freetoken/cpu_common.h"

namespace freetoken {
namespace {

template <typename Src, typename Dst>
void gather_rows(Dst* out, const RowView& orow, const Src* table, int64_t dim,
                 const int64_t* ids, int64_t tokens) {
  for (int64_t t = 0; t < tokens; ++t) {
    const Src* src = table + ids[t] * dim;
    Dst* dst = out + orow.offset(t);
    if constexpr (std::is_same_v<Src, Dst>) {
      std::memcpy(dst, src, dim * sizeof(Src));
    } else {
      for (int64_t i = 0; i < dim; ++i) dst[i] = from_float<Dst>(to_float(src[i]));
    }
  }
}

void embedding(TensorView out, TensorView ids, TensorView table) {
  check_contiguous(ids, "ids");
  check_dtype(ids, kDLInt, 64, "ids", "int64");
  check_ndim(ids, 1, "ids");
  check_contiguous(table, "table");
  check_ndim(table, 2, "table");
  FloatType table_type = float_type(table, "table");
  FloatType out_type = float_type(out, "out");
  const int64_t vocab = table.size(0), dim = table.size(1), tokens = ids.size(0);
  RowView orow = row_view(out, 1, "out");
  TVM_FFI_ICHECK(out.ndim() == 2 && orow.rows == tokens && orow.width == dim)
      << "out must be [" << tokens << ", " << dim << "] (ids length, table width)";
  const int64_t* idp = data_of<int64_t>(ids);
  for (int64_t t = 0; t < tokens; ++t) {
    TVM_FFI_ICHECK(idp[t] >= 0 && idp[t] < vocab)
        << "token id " << idp[t] << " (ids[" << t << "]) is outside the vocabulary of size "
        << vocab;
  }
  FT_DISPATCH_FLOAT(table_type, Src, {
    FT_DISPATCH_FLOAT(out_type, Dst, {
      gather_rows(data_of<Dst>(out), orow, data_of<Src>(table), dim, idp, tokens);
    });
  });
}

}  // namespace
}  // namespace freetoken

TVM_FFI_DLL_EXPORT_TYPED_FUNC(embedding, freetoken::embedding);
