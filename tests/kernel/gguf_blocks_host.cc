// Host build of kernels/include/freetoken/gguf_blocks.h (the GPU kernels' block decoding), so
// tests check it against gguf's numpy dequantizer on a machine without a GPU.
#include <cstdint>

#include "freetoken/gguf_blocks.h"

extern "C" int ft_gguf_dequantize(const uint8_t* data, int qtype, int64_t rows, int64_t cols,
                                  int64_t row_bytes, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!freetoken::gguf::dequantize_row(data + r * row_bytes, qtype, cols, out + r * cols))
      return 0;
  }
  return 1;
}
