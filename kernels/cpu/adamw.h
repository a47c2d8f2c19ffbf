// AdamW with decoupled weight decay, exactly torch.optim.AdamW's update. CPU twin of kernels/adamw.cuh.
#pragma once
#include <cstdint>

namespace tuna::cpu {

struct AdamWStep {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;  // 0 for tensors that do not decay (norm weights)
  int64_t step;         // 1-based, for bias correction
  double grad_scale;    // gradients are multiplied by this first (loss normalization x clipping)
};

// For each i: g = grad[i] * grad_scale; param *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// param -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). Updates param, m, v in place.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s);

// dst[i] += src[i] over n elements (sharded gradient accumulation). Accumulates dst.
void accumulate(float* dst, const float* src, int64_t n);

// Sum of squares of x in double, deterministic for a given n whatever the thread count.
double sum_of_squares(const float* x, int64_t n);

}  // namespace tuna::cpu
