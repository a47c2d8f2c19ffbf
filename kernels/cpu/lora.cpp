#include "kernels/cpu/lora.h"

#include "core/error.h"

namespace tuna::cpu {

void lora_dropout(float* dst, const float* src, int64_t rows, int64_t in, int64_t global_in, int64_t col0,
                  uint64_t stream_key, double p, bool accumulate) {
  TUNA_CHECK(rows >= 0 && in > 0 && global_in >= col0 + in && col0 >= 0, "lora_dropout: rows ", rows, ", in ", in,
             ", columns from ", col0, " of ", global_in);
  TUNA_CHECK(p >= 0 && p < 1, "lora_dropout: probability ", p, " outside [0, 1)");
  TUNA_CHECK(!(accumulate && dst == src), "lora_dropout: accumulating into its own input");
  const float keep = static_cast<float>(1.0 / (1.0 - p));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; row++)
    for (int64_t j = 0; j < in; j++) {
      const float v = lora_dropout_keeps(stream_key, row * global_in + col0 + j, p) ? src[row * in + j] * keep : 0.0f;
      float& out = dst[row * in + j];
      out = accumulate ? out + v : v;
    }
}

void scale(float* x, int64_t count, float s) {
  for (int64_t i = 0; i < count; i++) x[i] *= s;
}

}  // namespace tuna::cpu
