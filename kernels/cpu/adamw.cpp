// AdamW with decoupled weight decay, exactly torch.optim.AdamW's single-tensor, non-amsgrad update.
// CPU twin of kernels/adamw.cu. For each element, in double, stored back as float:
//
//   g = grad * grad_scale
//   param *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//
// param, m, v: [n], all UPDATED IN PLACE; grad is read only. Elements are independent, so the update is
// trivially deterministic. sum_of_squares (for the gradient norm) sums fixed-size chunks in parallel and
// then the chunk partials in order, so its result depends on n only, never on the thread count.
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/vector_math.h"

namespace tuna::cpu {
namespace {

// Elements per partial sum of sum_of_squares. Part of the result's definition: changing it changes the
// rounding of every gradient norm (and so breaks bit-exact resume against older runs).
constexpr int64_t kSumChunk = 8192;

// Elements per parallel work item of the update.
constexpr int64_t kUpdateBlock = 8192;

// The update of n consecutive elements, vectorized for the CPU's vector units (kernels/cpu/vector_math.h);
// elements are independent, so the vector width changes no result's definition, only which fused
// multiply-adds the compiler forms.
TUNA_CPU_CLONES void adamw_block(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s,
                                 double decay, double step_size, double bias_correction2_sqrt) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(grad[i]) * s.grad_scale;
    const double m_new = s.beta1 * m[i] + (1.0 - s.beta1) * g;
    const double v_new = s.beta2 * v[i] + (1.0 - s.beta2) * g * g;
    const double denom = std::sqrt(v_new) / bias_correction2_sqrt + s.eps;
    // Grouped as torch groups it: param.addcdiv_(m, denom, value=-step_size).
    param[i] = static_cast<float>(param[i] * decay - step_size * (m_new / denom));
    m[i] = static_cast<float>(m_new);
    v[i] = static_cast<float>(v_new);
  }
}

}  // namespace

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s) {
  TUNA_CHECK(n >= 0, "n ", n);
  TUNA_CHECK(s.step >= 1, "AdamW step is 1-based, got ", s.step);
  const double decay = 1.0 - s.lr * s.weight_decay;
  const double bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(s.beta2, static_cast<double>(s.step)));
  const double step_size = s.lr / bias_correction1;
  const int64_t blocks = (n + kUpdateBlock - 1) / kUpdateBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kUpdateBlock, count = std::min(kUpdateBlock, n - begin);
    adamw_block(param + begin, grad + begin, m + begin, v + begin, count, s, decay, step_size, bias_correction2_sqrt);
  }
}

void accumulate(float* dst, const float* src, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

double sum_of_squares(const float* x, int64_t n) {
  TUNA_CHECK(n >= 0, "n ", n);
  const int64_t n_chunks = (n + kSumChunk - 1) / kSumChunk;
  std::vector<double> partial(n_chunks);
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < n_chunks; ++chunk) {
    const int64_t begin = chunk * kSumChunk;
    const int64_t end = std::min(n, begin + kSumChunk);
    double sum = 0.0;
    for (int64_t i = begin; i < end; ++i) sum += static_cast<double>(x[i]) * x[i];
    partial[chunk] = sum;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace tuna::cpu
