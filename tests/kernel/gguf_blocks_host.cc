// Host build of kernels/include/freetoken/gguf_blocks.h (the GPU kernels' block decoding), so
// tests check it against gguf's numpy dequantizer on a machine without a GPU.
#include <cstdint>
#include <cstring>

#include "freetoken/gguf_blocks.h"

extern "C" int ft_gguf_dequantize(const uint8_t* data, int qtype, int64_t rows, int64_t cols,
                                  int64_t row_bytes, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!freetoken::gguf::dequantize_row(data + r * row_bytes, qtype, cols, out + r * cols))
      return 0;
  }
  return 1;
}

// out[r] = row r of the blocks . x (cols weights), summed unit by unit with dot32 as the GEMV.
extern "C" int ft_gguf_dot(const uint8_t* data, int qtype, int64_t rows, int64_t cols,
                           int64_t row_bytes, const float* x, float* out) {
  int weights, bytes;
  freetoken::gguf::block_shape(qtype, &weights, &bytes);
  if (weights == 0 || cols % weights != 0) return 0;
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t b = 0; b < cols / weights; ++b) {
      for (int u = 0; u < weights / 32; ++u) {
        acc += freetoken::gguf::dot32_any(data + r * row_bytes + b * bytes, qtype, u,
                                          x + b * weights + u * 32);
      }
    }
    out[r] = acc;
  }
  return 1;
}

// out[r] = row r of the blocks . x as gguf_gemv_q8 sums it: x holds cols int8 values, group g
// (values 32g..32g+31) with scale dx[g]; each unit meets its group's 8 words in dot32_q8 with
// sx = dx * the group's sum, the kernel's staging.
extern "C" int ft_gguf_dot_q8(const uint8_t* data, int qtype, int64_t rows, int64_t cols,
                              int64_t row_bytes, const int8_t* x, const float* dx, float* out) {
  int weights, bytes;
  freetoken::gguf::block_shape(qtype, &weights, &bytes);
  if (weights == 0 || cols % weights != 0) return 0;
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int64_t g = 0; g < cols / 32; ++g) {
      uint32_t words[8];
      std::memcpy(words, x + 32 * g, sizeof(words));
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += x[32 * g + i];
      const int64_t b = g * 32 / weights;
      acc += freetoken::gguf::dot32_q8_any(data + r * row_bytes + b * bytes, qtype,
                                           static_cast<int>(g % (weights / 32)), words, dx[g],
                                           dx[g] * static_cast<float>(sum));
    }
    out[r] = acc;
  }
  return 1;
}
