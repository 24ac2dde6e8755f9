// Host build of kernels/include/freetoken/fp8_words.h (the FP8 decode GEMV's byte decoding).
#include <cstdint>

#include "freetoken/fp8_words.h"

extern "C" void ft_e4m3x4_div256(const uint32_t* words, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) freetoken::fp8::e4m3x4_div256(words[i], out + 4 * i);
}
