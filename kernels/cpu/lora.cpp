// The element-wise parts of a LoRA adapter, CPU twin of kernels/lora.cu (fp32).
//
// The dropout mask is lora_dropout_keeps (kernels/cpu/lora.h) element by element, tested here as integers:
// (bits >> 11) 2^-53 >= p exactly when bits >> 11 >= ceil(p 2^53), both sides being exact (a 53-bit integer, and p
// scaled by a power of two), so a row is hashed and tested in 64-bit integer lanes (AVX-512's 64-bit multiply,
// TUNA_CPU_CLONES) instead of an element at a time: the mask is drawn for every adapter's input, and again in the
// backward, so drawing it is a pass over each input as long as the adapter's own products.
#include "kernels/cpu/lora.h"

#include <cmath>

#include "core/error.h"
#include "kernels/cpu/vector_math.h"  // TUNA_CPU_CLONES

namespace tuna::cpu {
namespace {

// dst[j] (= or +=) keep(first + j) ? src[j] * scale : 0 over one row of `in` elements; keep as lora_dropout_keeps.
TUNA_CPU_CLONES void dropout_row(float* dst, const float* src, int64_t in, uint64_t stream_key, uint64_t first,
                                 uint64_t threshold, float scale, bool accumulate) {
  if (accumulate) {
#pragma omp simd
    for (int64_t j = 0; j < in; j++) {
      const uint64_t bits = lora_mix(stream_key + 0x9E3779B97F4A7C15ull * (first + static_cast<uint64_t>(j) + 1));
      dst[j] += (bits >> 11) >= threshold ? src[j] * scale : 0.0f;
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < in; j++) {
      const uint64_t bits = lora_mix(stream_key + 0x9E3779B97F4A7C15ull * (first + static_cast<uint64_t>(j) + 1));
      dst[j] = (bits >> 11) >= threshold ? src[j] * scale : 0.0f;
    }
  }
}

}  // namespace

void lora_dropout(float* dst, const float* src, int64_t rows, int64_t in, int64_t global_in, int64_t col0,
                  uint64_t stream_key, double p, bool accumulate) {
  TUNA_CHECK(rows >= 0 && in > 0 && global_in >= col0 + in && col0 >= 0, "lora_dropout: rows ", rows, ", in ", in,
             ", columns from ", col0, " of ", global_in);
  TUNA_CHECK(p >= 0 && p < 1, "lora_dropout: probability ", p, " outside [0, 1)");
  TUNA_CHECK(!(accumulate && dst == src), "lora_dropout: accumulating into its own input");
  const float keep = static_cast<float>(1.0 / (1.0 - p));
  const uint64_t threshold = static_cast<uint64_t>(std::ceil(std::ldexp(p, 53)));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; row++)
    dropout_row(dst + row * in, src + row * in, in, stream_key, static_cast<uint64_t>(row * global_in + col0),
                threshold, keep, accumulate);
}

void scale(float* x, int64_t count, float s) {
  for (int64_t i = 0; i < count; i++) x[i] *= s;
}

}  // namespace tuna::cpu
