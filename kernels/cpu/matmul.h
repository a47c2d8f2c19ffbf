// Linear layers through BLAS, weights in nn.Linear's [out_features, in_features] layout.
// CPU twin of kernels/matmul.cuh (cuBLASLt).
#pragma once
#include <cstdint>

#include "kernels/cpu/grad_write.h"

namespace tuna::cpu {

// out[n, oc] = inp[n, ic] @ weight[oc, ic]^T. Overwrites out.
template <typename T>
void matmul_fwd(T* out, const T* inp, const T* weight, int64_t n, int64_t ic, int64_t oc);

// dinp[n, ic] (= or +=, by accumulate_dinp) dout[n, oc] @ weight[oc, ic]; skipped when dinp is null.
// dweight[oc, ic] (= or +=, by dweight_write) dout^T @ inp; skipped when dweight is null. Overwrite
// (kernels/cpu/grad_write.h) never reads dweight, and with n == 0 writes zeros.
template <typename T>
void matmul_bwd(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, int64_t n,
                int64_t ic, int64_t oc, bool accumulate_dinp, GradWrite dweight_write);

}  // namespace tuna::cpu
