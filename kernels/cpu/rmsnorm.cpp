// RMSNorm (HF LlamaRMSNorm), CPU twin of kernels/rmsnorm.cu.
//
//   forward:  rstd[i] = 1 / sqrt(mean_j inp[i, j]^2 + eps)             rstd: [n], OVERWRITTEN
//             out[i, j] = weight[j] * (inp[i, j] * rstd[i])            out:  [n, dim], OVERWRITTEN
//   backward: with g = dout, x = inp, r = rstd[i]:
//             dinp[i, j]  += r * (w[j] g[i, j] - x[i, j] * r^2 * mean_k(w[k] g[i, k] x[i, k]))   ACCUMULATED
//             dweight[j]  = or += sum_i g[i, j] x[i, j] r[i]                                    by dweight_write
//
// dinp accumulates because it is the residual stream's gradient; dweight accumulates over micro-batches after
// the step's first write, which overwrites (kernels/cpu/grad_write.h).
// Row sums are taken in double. dweight is a reduction over rows: threads split its columns and each
// sums its rows in order, so the result does not depend on the thread count.
#include "kernels/cpu/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/parallel.h"

namespace tuna::cpu {
namespace {

// Columns per parallel work item of the dweight reduction.
constexpr int64_t kColumnBlock = 64;

}  // namespace

template <typename T>
void rmsnorm_fwd(T* out, T* rstd, const T* inp, const T* weight, int64_t n, int64_t dim, double eps) {
  TUNA_CHECK(n >= 0 && dim > 0, "n ", n, ", dim ", dim);
#pragma omp parallel for schedule(static) if (n * dim >= kMinParallelWork)
  for (int64_t i = 0; i < n; ++i) {
    const T* x = inp + i * dim;
    double sum_sq = 0.0;
    for (int64_t j = 0; j < dim; ++j) sum_sq += static_cast<double>(x[j]) * x[j];
    // The stored rstd is the one the output is computed with, so the backward sees the same number.
    const T r = static_cast<T>(1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps));
    rstd[i] = r;
    T* y = out + i * dim;
    for (int64_t j = 0; j < dim; ++j) y[j] = weight[j] * (x[j] * r);
  }
}

template <typename T>
void rmsnorm_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const T* rstd,
                 int64_t n, int64_t dim, GradWrite dweight_write) {
  TUNA_CHECK(n >= 0 && dim > 0, "n ", n, ", dim ", dim);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const T* x = inp + i * dim;
    const T* g = dout + i * dim;
    const double r = rstd[i];
    double dot = 0.0;  // sum_k w[k] g[k] x[k]
    for (int64_t j = 0; j < dim; ++j) dot += static_cast<double>(weight[j]) * g[j] * x[j];
    const double correction = r * r * dot / static_cast<double>(dim);
    T* dx = dinp + i * dim;
    for (int64_t j = 0; j < dim; ++j) {
      const double grad = r * (static_cast<double>(weight[j]) * g[j] - x[j] * correction);
      dx[j] = static_cast<T>(dx[j] + grad);
    }
  }

  if (!dweight) return;  // a frozen weight (LoRA's base): the input gradient only
  const int64_t n_blocks = (dim + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static)
  for (int64_t block = 0; block < n_blocks; ++block) {
    const int64_t begin = block * kColumnBlock;
    const int64_t width = std::min(dim, begin + kColumnBlock) - begin;
    double sums[kColumnBlock] = {};
    for (int64_t i = 0; i < n; ++i) {
      const T* x = inp + i * dim + begin;
      const T* g = dout + i * dim + begin;
      const double r = rstd[i];
      for (int64_t j = 0; j < width; ++j) sums[j] += static_cast<double>(g[j]) * x[j] * r;
    }
    T* dw = dweight + begin;
    if (dweight_write == GradWrite::Overwrite)
      for (int64_t j = 0; j < width; ++j) dw[j] = static_cast<T>(sums[j]);
    else
      for (int64_t j = 0; j < width; ++j) dw[j] = static_cast<T>(dw[j] + sums[j]);
  }
}

template void rmsnorm_fwd<float>(float*, float*, const float*, const float*, int64_t, int64_t, double);
template void rmsnorm_fwd<double>(double*, double*, const double*, const double*, int64_t, int64_t, double);
template void rmsnorm_bwd<float>(float*, float*, const float*, const float*, const float*, const float*,
                                 int64_t, int64_t, GradWrite);
template void rmsnorm_bwd<double>(double*, double*, const double*, const double*, const double*,
                                  const double*, int64_t, int64_t, GradWrite);

}  // namespace tuna::cpu
