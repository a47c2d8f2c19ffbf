// int8 row-wise absmax, the CPU twin (contract: kernels/cpu/int8_rowwise.h). The roundings are torch's for
// bitsandbytes' `A * (127.0 / row_stats)`: Python's `127.0 / t` is `t.reciprocal() * 127.0`, two fp32 roundings,
// then torch.round (half to even).
#include "kernels/cpu/int8_rowwise.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

template <typename Out>
void dequantize_impl(const int8_t* q, const float* scale, int64_t rows, int64_t cols, Out* out) {
#pragma omp parallel for if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float scaled = static_cast<float>(q[r * cols + c]) * scale[r];
      const float w = scaled * kInt8InvScale;
      if constexpr (std::is_same_v<Out, float>)
        out[r * cols + c] = w;
      else
        out[r * cols + c] = f32_to_bf16(w);
    }
}

}  // namespace

void int8_rowwise_quantize(const float* w, int64_t rows, int64_t cols, int8_t* q, float* scale, const char* what) {
  TUNA_CHECK(rows >= 0 && cols >= 0, "int8_rowwise_quantize of ", rows, " x ", cols);
  for (int64_t i = 0; i < rows * cols; ++i)
    if (!std::isfinite(w[i]))
      fail(what, ": element ", i, " is ", w[i], "; int8 quantization needs finite weights");
#pragma omp parallel for if (rows * cols >= kMinParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    float m = 0.0f;
    for (int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(row[c]));
    scale[r] = m;
    const float factor = (1.0f / m) * 127.0f;  // inf for a row of zeros
    for (int64_t c = 0; c < cols; ++c)
      q[r * cols + c] = m == 0.0f ? int8_t{0} : static_cast<int8_t>(std::nearbyint(row[c] * factor));
  }
}

void int8_rowwise_dequantize(const int8_t* q, const float* scale, int64_t rows, int64_t cols, float* out) {
  dequantize_impl(q, scale, rows, cols, out);
}
void int8_rowwise_dequantize(const int8_t* q, const float* scale, int64_t rows, int64_t cols, uint16_t* out_bf16) {
  dequantize_impl(q, scale, rows, cols, out_bf16);
}

}  // namespace tuna::cpu
