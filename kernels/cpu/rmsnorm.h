// RMSNorm as in LLaMA (HF LlamaRMSNorm). CPU twin of kernels/rmsnorm.cuh.
#pragma once
#include <cstdint>

#include "kernels/cpu/grad_write.h"

namespace tuna::cpu {

// rstd[i] = 1 / sqrt(mean_j(inp[i, j]^2) + eps);  out[i, j] = inp[i, j] * rstd[i] * weight[j].
// inp, out: [n, dim]; weight: [dim]; rstd: [n] (kept for the backward). Overwrites out and rstd.
template <typename T>
void rmsnorm_fwd(T* out, T* rstd, const T* inp, const T* weight, int64_t n, int64_t dim, double eps);

// Gradients of the above. ACCUMULATES into dinp (it is the residual stream's gradient); dweight is overwritten
// or accumulated by dweight_write (kernels/cpu/grad_write.h; Overwrite never reads it); null dweight: skipped (a
// frozen weight: only the input gradient is wanted).
template <typename T>
void rmsnorm_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const T* rstd,
                 int64_t n, int64_t dim, GradWrite dweight_write);

}  // namespace tuna::cpu
